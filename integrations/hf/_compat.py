"""The installed Hugging Face transformers. Every nvrx_hf module takes it from here, so a
missing one is named once, with the fix."""

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError("nvrx_hf needs Hugging Face transformers: pip install 'nvrx-suite[hf]'") from None

from transformers.trainer_callback import ExportableState

__all__ = ["transformers", "TrainerCallback", "TrainerControl", "TrainerState", "TrainingArguments",
           "ExportableState"]
