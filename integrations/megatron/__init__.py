"""Imported as `nvrx_megatron`.

Megatron-Bridge-compatible configs (FaultToleranceConfig, ...) and loop hooks for nvrx-suite. Coming with the issues that build them;
the mechanisms themselves live in nvrx_core.
"""
