"""The pyramid's verification loop (qualifier -> target), run inside `generate()`.

Transformers has already prepared everything plain `generate()` would: the processed logits
processors (temperature / top-k / top-p / repetition penalty ...), the stopping criteria (max
length, EOS, stop strings), the streamer and the target's cache. The loop emits accepted tokens
one at a time through the stopping criteria, so it stops on exactly the token plain decoding
stops on, and `max_new_tokens` is honoured exactly.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import get_rule
from .candidate_generator import pick_token, process_rows
from .levels import ModelLevel

_IGNORED_MODEL_KWARGS = {"cache", "use_cache", "attention_mask", "position_ids", "logits_to_keep", "cache_position"}


def _check_inputs(model, input_ids, generation_config, synced_gpus, model_kwargs) -> None:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"PyramidAssistant supports batch size 1 (as Transformers' assisted generation), got batch size "
            f"{input_ids.shape[0]}; call generate() once per prompt."
        )
    if synced_gpus:
        raise ValueError("PyramidAssistant does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    if model.config.is_encoder_decoder:
        raise ValueError("PyramidAssistant supports decoder-only target models.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("PyramidAssistant does not return attentions or hidden states; unset output_attentions/"
                         "output_hidden_states.")
    cache = model_kwargs.get("cache")
    if cache is not None and not isinstance(cache, DynamicCache):
        raise ValueError(
            f"PyramidAssistant needs a croppable dynamic cache; got {type(cache).__name__} "
            f"(cache_implementation={generation_config.cache_implementation!r})."
        )
    extra = sorted(k for k, v in model_kwargs.items() if k not in _IGNORED_MODEL_KWARGS and v is not None)
    if extra:
        raise ValueError(f"PyramidAssistant does not support these model inputs: {extra}")


@torch.no_grad()
def pyramid_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    assistant=None,
    **model_kwargs,
):
    """Decode with ``assistant`` (a `PyramidAssistant`) for ``model`` (the target)."""
    _check_inputs(model, input_ids, generation_config, synced_gpus, model_kwargs)
    start = time.perf_counter()
    stats = assistant._begin_call()
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and bool((attention_mask == 1).all()):
        attention_mask = None
    target = ModelLevel(model, "target", stats, cache=model_kwargs.get("cache"))
    generator = assistant.build_candidate_generator(model, logits_processor, generation_config, stats, attention_mask)
    config = assistant.config
    target_rule = get_rule(config.target_rule)
    do_sample = bool(generation_config.do_sample)

    want_dict = generation_config.return_dict_in_generate
    scores = () if (want_dict and generation_config.output_scores) else None
    raw_logits = () if (want_dict and generation_config.output_logits) else None
    prompt_length = input_ids.shape[1]
    finished = False
    while not finished:
        length = input_ids.shape[1]
        candidate_ids, candidate_logits = generator.get_candidates(input_ids)
        m = candidate_ids.shape[1] - length
        mask = generator.attention_mask_for(candidate_ids.shape[1])
        target_logits = target.next_token_logits(candidate_ids, m + 1, mask)  # (m + 1, V)
        target_scores = process_rows(logits_processor, candidate_ids, target_logits)
        target_probs = target_scores.softmax(-1)
        if m:
            qualifier_probs = candidate_logits[0].to(target_probs.device).exp()  # (m, V)
            n, next_token = target_rule(
                candidate_ids[0, length:], qualifier_probs, target_probs,
                do_sample=do_sample, tau=config.tau_target, divergence=config.divergence,
            )
        else:
            n, next_token = 0, pick_token(target_probs[0], do_sample)
        stats.record_outer(m, n)
        new_tokens = torch.cat([candidate_ids[0, length : length + n], next_token.view(1).to(input_ids.device)])

        emitted = 0
        for j in range(new_tokens.shape[0]):  # one token at a time through the stopping criteria
            input_ids = torch.cat([input_ids, new_tokens[j].view(1, 1)], dim=1)
            emitted += 1
            if scores is not None:
                scores += (target_scores[j : j + 1],)
            if raw_logits is not None:
                raw_logits += (target_logits[j : j + 1],)
            if bool(stopping_criteria(input_ids, scores).any()):
                finished = True
                break
        if streamer is not None:
            streamer.put(input_ids[:, -emitted:].cpu())
        generator.update_candidate_strategy(input_ids, target_scores[: m + 1][None], n)

    if streamer is not None:
        streamer.end()
    stats.new_tokens = input_ids.shape[1] - prompt_length
    stats.wall_time_s = time.perf_counter() - start
    assistant._end_call(stats)
    if want_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, cache=target.cache)
    return input_ids
