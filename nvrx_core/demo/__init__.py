"""The demo job and `nvrx demo` runner."""
