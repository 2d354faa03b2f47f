"""dsec: content-addressed layers and sandboxes for agentic-RL environments."""

__version__ = "0.1.0"
