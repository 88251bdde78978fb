"""sparse-llm: ReLU-gated Llama models with L1-sparse feedforward activations and TwELL sparse kernels."""

__version__ = "0.1.0"
