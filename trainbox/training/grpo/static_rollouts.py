"""GRPOTrainer whose rollouts without vLLM come from static_decode.py instead of transformers' generate.

TRL's no-vLLM path calls `generate` on the training model itself (float32 weights under autocast, a dynamic cache,
compile off): CPU-bound, ~4 s a rollout of 16 x 256 tokens for a 1.2B model on an H100. Here a bfloat16 decoder copy
of the policy, synced when the weights have changed (once a step, as TRL syncs vLLM), samples the completions with
one CUDA-graphed decode step. Completions come back as TRL's own path returns them (token ids up to and including
the end token, no sampling log-probs: generation and training see the same weights, on-policy).

Anything the decoder does not cover goes to TRL's method: vision-language models and images, FSDP or DeepSpeed
(the decoder needs the whole model on each GPU), vLLM or transformers' continuous batching, and a model whose decode
step does not compile into a CUDA graph (Mixtral's and Qwen3-MoE's expert loops, on an H100): uncompiled it would
be no faster than transformers' generate.
"""

from __future__ import annotations

import importlib.util
import sys

from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from trainbox.run import outputs
from trainbox.training.grpo.static_decode import StaticDecoder, StepNotCompiled


class StaticDecodeRollouts(GRPOTrainer):
    """Mixin (before TRL's GRPOTrainer or a subclass of it): see the module docstring."""

    _decoder = None
    _decoder_step = None
    _decoder_off = None  # why TRL's path runs instead, once said

    def _decoder_blocker(self, images, multimodal_fields) -> str | None:
        if self.use_vllm or self.use_transformers_continuous_batching:
            return "vLLM / continuous batching generate"
        if images is not None or multimodal_fields:
            return "images in the batch"
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return "FSDP/DeepSpeed shard the weights the decoder copies"
        model = self.accelerator.unwrap_model(self.model)
        if model.config.get_text_config() is not model.config:
            return "a vision-language model"
        return None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        why = self._decoder_off or self._decoder_blocker(images, multimodal_fields)
        if not why:
            try:
                return self._decode(prompt_ids), None
            except StepNotCompiled as error:  # uncompiled it would be no faster than transformers' generate
                why = f"its decode step did not compile: {error}"
                self._decoder = None  # its weights and cache go back to the policy's training
        if why != self._decoder_off and outputs.is_main_process():
            hint = ("; vLLM is installed: `--use_vllm true` generates with it"
                    if importlib.util.find_spec("vllm") is not None else "")
            print(f"[trainbox] grpo: static decode off ({why}): transformers generate{hint}", file=sys.stderr,
                  flush=True)
        self._decoder_off = why
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _decode(self, prompt_ids):
        policy = self.accelerator.unwrap_model(self.model)
        if self._decoder is None:
            tok = self._tokenizer
            pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_ids[0]
            self._decoder = StaticDecoder(policy, self.max_completion_length, pad, self.eos_token_ids,
                                          self.temperature, uncompiled_fallback=False)
            self._decoder_step = self.state.global_step
            if self._decoder.compile and outputs.is_main_process():  # the first rollout pauses: say why
                print("[trainbox] grpo: static decode: compiling the decode step into a CUDA graph (once, and again "
                      "if prompts outgrow the cache; 30-60 s on an H100/H200)", flush=True)
        elif self._decoder_step != self.state.global_step:
            with profiling_context(self, "static_decode.sync"):
                self._decoder.sync(policy)
            self._decoder_step = self.state.global_step
        with profiling_context(self, "static_decode.generate"):
            return self._decoder.generate(prompt_ids)
