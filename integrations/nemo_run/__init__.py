"""Imported as `nvrx_nemo_run`.

NeMo-Run plugins that switch nvrx-suite on: `run.run(task, executor=..., plugins=[FaultTolerancePlugin(),
PreemptionPlugin()])`. Importable without nemo_run (a plugin's `setup` then names the extra to install).
"""

from nvrx_nemo_run.plugins import (FaultTolerancePlugin, InProcessRestartPlugin, PreemptionPlugin,
                                   StragglerDetectionPlugin)
from nvrx_nemo_run.script_args import (FaultTolerancePluginScriptArgs, InProcessRestartPluginScriptArgs,
                                       PreemptionPluginScriptArgs, StragglerDetectionPluginScriptArgs)

__all__ = ["FaultTolerancePlugin", "FaultTolerancePluginScriptArgs", "InProcessRestartPlugin",
           "InProcessRestartPluginScriptArgs", "PreemptionPlugin", "PreemptionPluginScriptArgs",
           "StragglerDetectionPlugin", "StragglerDetectionPluginScriptArgs"]
