"""Kernels and model patches of the trainers: attention kernels, MoE experts, the loss head, fused steps, and what
their compiled paths fall back to.
"""
