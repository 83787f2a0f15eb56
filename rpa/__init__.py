"""rpa: rounding position alignment for BF16 LLM reinforcement learning.

Importing this package has no side effects: the vLLM plugin registers nothing until
vLLM calls :func:`rpa.sides.vllm_plugin.register`, and the trainer patch is applied only by
:func:`rpa.sides.trainer.align_model`.
"""

__version__ = "0.1.0"
