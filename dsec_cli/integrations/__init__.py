"""Adapters that run dsec sandboxes inside agent and RL frameworks, one module each, each behind
its optional extra."""
