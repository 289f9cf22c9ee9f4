"""postrl: RL post-training for language models (PPO, GRPO and family, agentic RL).

Importing ``postrl`` is cheap: it imports neither ray, transformers, vllm nor sglang.
See DESIGN.md for the map of the system.
"""

__version__ = "0.1.0"
