"""nvrx_core: the framework-agnostic core of nvrx-suite.

Every mechanism lives here; the Lightning, Megatron-style and NeMo-Run adapters
(`nvrx_lightning`, `nvrx_megatron`, `nvrx_nemo_run`) only translate it into their idioms.
"""

__version__ = "0.1.0"
