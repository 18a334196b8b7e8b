"""GRPO's trainer library: options, data and rewards, rollout engines (static decoder, vLLM), GRPOTrainer mixins.
"""
