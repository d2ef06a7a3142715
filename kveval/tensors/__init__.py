"""Tensor algorithms below everything else: quantization codes and bit packing, the padded batch buffer, blockwise attention probabilities, ranking, and the scoring state."""
