"""nvidia-resiliency-ext's straggler-callback vocabulary, for every framework's callback.

nvidia-resiliency-ext's StragglerDetectionCallback names five of StragglerConfig's knobs after
GPUs (`gpu_relative_perf_threshold` ...) and logs its scores under GPU names too. nvrx_lightning's
and nvrx_hf's callbacks take those argument names, so a callback list ports by changing the
import; this module turns them into a StragglerConfig and words its errors back in them.
"""

import re
import statistics
from typing import Any, Dict, Mapping

from nvrx_core.config import ConfigError, build
from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.straggler.report import Report
from nvrx_core.straggler.timers import OVERALL

RENAMED = {
    "calc_relative_gpu_perf": "calc_relative_perf",
    "calc_individual_gpu_perf": "calc_individual_perf",
    "num_gpu_perf_scores_to_print": "num_scores_to_print",
    "gpu_relative_perf_threshold": "relative_perf_threshold",
    "gpu_individual_perf_threshold": "individual_perf_threshold",
}
"""The callback's argument -> StragglerConfig's field, where the names differ."""
ARGUMENTS = ("report_time_interval", *RENAMED, "stop_if_detected", "profiling_interval", "logger_name")
"""Every argument of the peer's callback that sets a StragglerConfig field."""
SCORE_PREFIXES = (("gpu_relative_perf", "relative"), ("gpu_individual_perf", "individual"))


def straggler_config(arguments: Mapping[str, Any], extra: Mapping[str, Any], source: str) -> StragglerConfig:
    """StragglerConfig from a callback's `arguments` (its own names: those of ARGUMENTS are
    taken, so a callback may pass its `locals()`) and `extra` further StragglerConfig fields by
    their core names; a core name that one of the arguments already sets is refused, naming the
    argument to use."""
    arguments = {name: value for name, value in arguments.items() if name in ARGUMENTS}
    argument_of = {core: name for name, core in RENAMED.items()}
    for key in extra:
        if key in arguments or key in argument_of:
            raise ConfigError(f"{key}: set it with this callback's argument {argument_of.get(key, key)!r}")
    try:
        return build(StragglerConfig, {RENAMED.get(k, k): v for k, v in arguments.items()}, extra, source=source)
    except ConfigError as e:
        raise ConfigError(in_argument_names(str(e))) from None


def in_argument_names(message: str) -> str:
    """A StragglerConfig error re-worded with the callback's argument names."""
    for name, core in RENAMED.items():
        message = re.sub(rf"\b{core}\b", name, message)
    return message


def score_summaries(report: Report) -> Dict[str, float]:
    """The peer's logged keys: min, median and max over ranks of the per-step scores."""
    metrics = {}
    for prefix, kind in SCORE_PREFIXES:
        scores = list(getattr(report, kind).get(OVERALL, {}).values())
        if scores:
            metrics[f"{prefix}/min"] = float(min(scores))
            metrics[f"{prefix}/median"] = float(statistics.median(scores))
            metrics[f"{prefix}/max"] = float(max(scores))
    return metrics
