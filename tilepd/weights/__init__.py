"""tilepd.weights: HF checkpoint -> tilepd runtime weights (convert-weights), and the loader the engine uses."""

from tilepd.weights.convert import ConvertResult, convert_weights
from tilepd.weights.source import WeightsError

__all__ = ["ConvertResult", "WeightsError", "convert_weights"]
