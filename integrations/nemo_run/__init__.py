"""Imported as `nvrx_nemo_run`.

NeMo-Run plugins (FaultTolerancePlugin, PreemptionPlugin) for nvrx-suite. Coming with the issues that build them;
the mechanisms themselves live in nvrx_core.
"""
