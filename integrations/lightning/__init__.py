"""Imported as `nvrx_lightning`.

Lightning callbacks (NVRxFaultTolerance, straggler, checkpoint IO) for nvrx-suite. Coming with the issues that build them;
the mechanisms themselves live in nvrx_core.
"""
