"""Prompts longer than CLIP's 77-token window: chunked embeddings, or truncation reported to the caller.

CLIP's text encoders see at most 77 tokens: BOS, 75 content tokens, EOS (then padding). Stock diffusers
truncates anything longer, and only logs it for the positive prompt (the negative prompt is truncated
without a word). sdfast offers two policies, both reported (``warnings.warn`` and each image's ``info``):

- ``"chunk"`` (default): the content tokens are split into windows of 75; each window is encoded on
  its own as ``[BOS] + window + [EOS] + padding`` (77 tokens) and the window embeddings are concatenated
  along the sequence, so the UNet cross-attends to 77·k tokens. Prompt and negative prompt (and every
  prompt of a batch) are padded to the same number of windows with empty windows (``[BOS, EOS, pad…]``,
  the encoding of ""). SDXL: both encoders are chunked the same way (penultimate hidden states,
  concatenated along features as diffusers does) and the pooled embedding is the second encoder's pooled
  output of the first window. This is the method of AUTOMATIC1111's web UI and of compel (without their
  comma-aware window boundaries and emphasis weights). A prompt that fits in one window is encoded in
  one window, as diffusers encodes it, so it gives stock's image exactly; on a pipeline that
  ``sdfast.optimize`` gave CUDA graphs, prompt and negative prompt go in one encoder batch
  (``encode_chunked(..., batch_cfg=True)``): the same token ids and embeddings up to the GEMMs' rounding.
- ``"truncate"``: stock diffusers' behaviour (tokens after the 75th are dropped), with the number of
  dropped tokens reported.

Every text is tokenized once (``tokenize``: one ``PromptTokens`` per request, carried by
``sdfast.request.Txt2ImgRequest``); counting (``plan``) and encoding (``encode_chunked``) read those ids, and the
engine hands the pipeline embeddings (``prompt_embeds`` ...), so diffusers does not tokenize again. A text that
fits in one window is encoded exactly as diffusers' ``encode_prompt`` encodes it (same ids, same encoder call).

Token counts are in CLIP BPE tokens, after textual-inversion expansion (``maybe_convert_prompt``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

WINDOW = 75  # content tokens per CLIP window (77 minus BOS and EOS)
POLICIES = ("chunk", "truncate")


@dataclass(frozen=True)
class PromptReport:
    """Token accounting of one request.

    tokens / negative_tokens: content tokens of each prompt (of each negative prompt, or None).
    chunks: 77-token windows each prompt was encoded in (1 when every text fits, or with "truncate").
    truncated / negative_truncated: tokens dropped from each prompt (all 0 with "chunk").
    """

    policy: str
    tokens: list[int]
    negative_tokens: list[int] | None
    chunks: int
    truncated: list[int]
    negative_truncated: list[int] | None

    @property
    def any_truncated(self) -> bool:
        return any(self.truncated) or any(self.negative_truncated or ())


def _tokenizers(pipe) -> list:
    return [t for t in (getattr(pipe, "tokenizer", None), getattr(pipe, "tokenizer_2", None)) if t is not None]


_TOO_LONG = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' once-per-tokenizer flag


@contextlib.contextmanager
def _no_length_warning(tokenizer):
    """Inside: the tokenizer's own "already warned" flag for "Token indices sequence length is longer than the
    specified maximum sequence length" is set (this module windows long texts, so nothing is indexed past 77);
    afterwards it is as it was, so diffusers' own calls still warn."""
    flags = getattr(tokenizer, "deprecation_warnings", None)
    if not isinstance(flags, dict):
        yield
        return
    had, before = _TOO_LONG in flags, flags.get(_TOO_LONG)
    flags[_TOO_LONG] = True
    try:
        yield
    finally:
        if had:
            flags[_TOO_LONG] = before
        else:
            flags.pop(_TOO_LONG, None)


def _convert(pipe, texts: list[str], tokenizer) -> list[str]:
    """Textual-inversion expansion of multi-vector tokens, as diffusers' ``encode_prompt`` does."""
    convert = getattr(pipe, "maybe_convert_prompt", None)
    if convert is None:
        return list(texts)
    with _no_length_warning(tokenizer):  # it tokenizes the whole text (``tokenizer.tokenize``) without a flag
        return convert(list(texts), tokenizer)


def content_ids(pipe, texts: list[str], tokenizer=None) -> list[list[int]]:
    """CLIP token ids of each text, without BOS/EOS and without truncation."""
    tokenizer = tokenizer or _tokenizers(pipe)[0]
    texts = _convert(pipe, texts, tokenizer)
    return [tokenizer(t, add_special_tokens=False, verbose=False).input_ids for t in texts]


Ids = tuple[tuple[int, ...], ...]  # content token ids of each text


@dataclass(frozen=True)
class PromptTokens:
    """The content token ids of a request's texts, computed once (``tokenize``), for each tokenizer of the
    pipeline (SD: ``tokenizer``; SDXL: ``tokenizer`` and ``tokenizer_2``).

    prompts: ``prompts[t][i]``: ids of prompt i with tokenizer t (no BOS/EOS, untruncated).
    negatives: the same for the negative prompts, or None (no negative prompt, or not needed: no CFG).
    vocab: ``len(tokenizer)`` of each tokenizer when the ids were made; a textual inversion loaded later adds
        tokens, and ``fits`` then says False (the engine tokenizes again rather than encode stale ids).
    """

    prompts: tuple[Ids, ...]
    negatives: tuple[Ids, ...] | None
    vocab: tuple[int, ...]

    def windows(self) -> tuple[int, int]:
        """(77-token windows of the longest prompt, of the longest negative prompt (1 without one)), first
        tokenizer, as ``plan`` counts them with ``long_prompt="chunk"``."""
        neg = max(map(len, self.negatives[0]), default=0) if self.negatives is not None else 0
        return windows_needed(max(map(len, self.prompts[0]), default=0)), windows_needed(neg)

    def fits(self, pipe, n_prompts: int, with_negatives: bool) -> bool:
        """Whether these ids are ``pipe``'s (same tokenizers and vocabularies) for ``n_prompts`` prompts and,
        with ``with_negatives``, as many negative prompts."""
        if self.vocab != tuple(len(t) for t in _tokenizers(pipe)) or any(len(p) != n_prompts for p in self.prompts):
            return False
        return not with_negatives or (self.negatives is not None and all(len(n) == n_prompts for n in self.negatives))

    @staticmethod
    def concat(parts: list[PromptTokens | None]) -> PromptTokens | None:
        """The tokens of requests batched into one call (prompts in order), or None when a part has none or
        the parts come from different vocabularies or disagree on negative prompts."""
        if not parts or any(p is None for p in parts) or len({(p.vocab, p.negatives is None) for p in parts}) != 1:
            return None
        first = parts[0]
        prompts = tuple(sum((p.prompts[t] for p in parts), ()) for t in range(len(first.vocab)))
        negatives = None if first.negatives is None else tuple(
            sum((p.negatives[t] for p in parts), ()) for t in range(len(first.vocab)))
        return PromptTokens(prompts, negatives, first.vocab)


def tokenize(pipe, prompts: list[str], negative_prompts: list[str] | None, *, tokenizers=None) -> PromptTokens:
    """``PromptTokens`` of ``prompts`` (and ``negative_prompts``) with each of ``pipe``'s tokenizers, each
    distinct text tokenized once. ``tokenizers``: copies of ``pipe``'s tokenizers to use instead (a thread other
    than the one running the pipeline must not share a fast tokenizer with it)."""
    tokenizers = list(tokenizers) if tokenizers is not None else _tokenizers(pipe)
    texts = list(dict.fromkeys([*prompts, *(negative_prompts or [])]))
    per_tokenizer = [dict(zip(texts, content_ids(pipe, texts, t))) for t in tokenizers]
    ids = [tuple(tuple(table[p]) for p in prompts) for table in per_tokenizer]
    neg = None if negative_prompts is None else [tuple(tuple(table[p]) for p in negative_prompts)
                                                  for table in per_tokenizer]
    return PromptTokens(tuple(ids), None if neg is None else tuple(neg), tuple(len(t) for t in tokenizers))


def windows_needed(n_tokens: int) -> int:
    """77-token windows that ``n_tokens`` content tokens need (at least 1)."""
    return max(1, math.ceil(n_tokens / WINDOW))


def windows_of(pipe, text: str) -> int:
    """77-token windows ``text`` needs with ``long_prompt="chunk"`` (1 when it fits). Prompts batched in one
    call are padded to the batch's largest count, which changes the image of a shorter one: a service that
    batches requests should batch only texts with the same count to keep "batched == alone"."""
    return windows_needed(len(content_ids(pipe, [text])[0]))


def plan(pipe, prompts: list[str], negative_prompts: list[str] | None, policy: str, *,
         tokens: PromptTokens | None = None) -> PromptReport:
    """Count tokens and decide the number of windows (see the module docstring). No encoder runs.
    ``tokens``: the texts' ids from ``tokenize`` (else they are tokenized here)."""
    if policy not in POLICIES:
        raise ValueError(f"long_prompt must be one of {POLICIES}, got {policy!r}")
    if tokens is None:
        tokens = tokenize(pipe, prompts, negative_prompts)
    neg = [len(i) for i in tokens.negatives[0]] if negative_prompts is not None else None
    tokens = [len(i) for i in tokens.prompts[0]]
    if policy == "chunk":
        chunks = max(windows_needed(n) for n in tokens + (neg or []))
        truncated, neg_truncated = [0] * len(tokens), ([0] * len(neg) if neg is not None else None)
    else:
        chunks = 1
        truncated = [max(0, n - WINDOW) for n in tokens]
        neg_truncated = [max(0, n - WINDOW) for n in neg] if neg is not None else None
    return PromptReport(policy, tokens, neg, chunks, truncated, neg_truncated)


def _window_ids(tokenizer, ids: list[int], k: int) -> list[torch.Tensor]:
    """The k (1, 77) id tensors of one text: its 75-token windows, then empty windows up to k."""
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    pieces = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)] or [[]]
    pieces += [[]] * (k - len(pieces))
    return [torch.tensor([[bos, *p, eos] + [pad] * (WINDOW - len(p))]) for p in pieces]


def _attention_mask(window: torch.Tensor, n_content: int) -> torch.Tensor:
    mask = torch.zeros_like(window)
    mask[:, : n_content + 2] = 1
    return mask


def _encode_windows(pipe, ids_per_tokenizer: list[Ids], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, 77·k, D) embeddings of the B texts whose content ids (per tokenizer) are given (and SDXL's (B, D2)
    pooled embedding of window 0)."""
    device = pipe._execution_device
    is_xl = getattr(pipe, "text_encoder_2", None) is not None
    per_encoder, pooled = [], None
    encoders = [e for e in (pipe.text_encoder, getattr(pipe, "text_encoder_2", None)) if e is not None]
    for tokenizer, encoder, ids in zip(_tokenizers(pipe), encoders, ids_per_tokenizer):
        windows = [_window_ids(tokenizer, list(i), k) for i in ids]  # B lists of k (1, 77) tensors
        outs = []
        for w in range(k):
            batch = torch.cat([windows[b][w] for b in range(len(ids))]).to(device)
            if is_xl:
                out = encoder(batch, output_hidden_states=True)
                if w == 0 and out[0].ndim == 2:  # CLIPTextModelWithProjection: the pooled projection
                    pooled = out[0]
                outs.append(out.hidden_states[-2])
            else:
                mask = None
                if getattr(encoder.config, "use_attention_mask", False):
                    mask = torch.cat([
                        _attention_mask(windows[b][w], max(0, min(WINDOW, len(ids[b]) - w * WINDOW)))
                        for b in range(len(ids))
                    ]).to(device)
                outs.append(encoder(batch, attention_mask=mask)[0])
        per_encoder.append(torch.cat(outs, dim=1))
    embeds = torch.cat(per_encoder, dim=-1)
    dtype = pipe.text_encoder_2.dtype if is_xl else pipe.text_encoder.dtype
    return embeds.to(device=device, dtype=dtype), (pooled.to(device=device, dtype=dtype) if pooled is not None else None)


@torch.no_grad()
def encode_chunked(pipe, prompts: list[str], negative_prompts: list[str] | None, k: int, *, do_cfg: bool,
                   batch_cfg: bool = False, tokens: PromptTokens | None = None) -> dict:
    """Pipeline keyword arguments (``prompt_embeds``, ``negative_prompt_embeds`` and, for SDXL, the pooled
    ones) that encode every text in k windows. For SDXL without a negative prompt and with
    ``force_zeros_for_empty_prompt``, the negative embeddings are left to diffusers (zeros of the same shape).

    ``batch_cfg``: prompts and negative prompts go through each text encoder in one batch, one call per window
    instead of two (diffusers encodes them one after the other). On a CUDA-graphed encoder that is one replay
    fewer per encoder; CLIP at 77 tokens is bound by reading its weights, so a batch of 2 costs about what a
    batch of 1 does. The embeddings equal the separate calls' up to the GEMMs' rounding (a few 1e-7 on the CPU).

    ``tokens``: the texts' ids from ``tokenize`` (with the negative prompts when there are any and ``do_cfg``);
    else they are tokenized here. The empty negative prompt (CFG without one) has no content tokens."""
    is_xl = getattr(pipe, "text_encoder_2", None) is not None
    zeros = is_xl and negative_prompts is None and pipe.config.force_zeros_for_empty_prompt
    use_negatives = do_cfg and not zeros
    if tokens is None:
        tokens = tokenize(pipe, prompts, negative_prompts if use_negatives else None)
    n = len(prompts)
    ids, neg_ids = list(tokens.prompts), None
    if use_negatives:
        neg_ids = list(tokens.negatives) if negative_prompts else [((),) * n] * len(ids)
    if batch_cfg and neg_ids is not None:
        both, both_pooled = _encode_windows(pipe, [p + q for p, q in zip(ids, neg_ids)], k)
        embeds, neg_embeds = both[:n], both[n:]
        pooled, neg_pooled = (both_pooled[:n], both_pooled[n:]) if both_pooled is not None else (None, None)
    else:
        embeds, pooled = _encode_windows(pipe, ids, k)
        neg_embeds, neg_pooled = _encode_windows(pipe, neg_ids, k) if neg_ids is not None else (None, None)
    kwargs = {"prompt_embeds": embeds}
    if is_xl:
        kwargs["pooled_prompt_embeds"] = pooled
    if neg_embeds is not None:
        kwargs["negative_prompt_embeds"] = neg_embeds
        if is_xl:
            kwargs["negative_pooled_prompt_embeds"] = neg_pooled
    return kwargs
