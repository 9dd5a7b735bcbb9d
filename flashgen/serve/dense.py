"""The dense reference loop and the check of the engine against it.

The dense loop serves one request at a time with no paging: each layer's K/V is one tensor per request,
concatenated as tokens are generated, and attention is plain fp64 causal attention over it
(``model.dense_attention``). The engine's tokens are checked against it.

The rule: the engine's output must equal the dense loop's token for token. Where they first differ, the
difference is accepted only if the dense loop's logits at that token are a near-tie: the gap between its
best logit and the logit of the engine's token is at most ``tol`` (paged and dense attention round in
different orders; in fp32 on the CPU the logits agree to ~1e-5, so the default ``tol = 1e-3`` never
excuses a real error). The streams are not compared past an accepted near-tie (they diverge there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import TinyLlama, dense_attention, sample


def dense_generate(model: TinyLlama, prompt: list[int], max_new_tokens: int, rid: int = 0,
                   temperature: float = 0.0, seed: int = 0) -> tuple[list[int], list[torch.Tensor]]:
    """Serve one request densely: prefill the prompt, then decode one token at a time. Returns the output
    tokens and the logits ``[vocab]`` each was chosen from."""
    layers = model.config.num_layers
    ks: list[torch.Tensor | None] = [None] * layers
    vs: list[torch.Tensor | None] = [None] * layers

    def attend(layer: int, q, k, v, start: int):
        ks[layer] = k if ks[layer] is None else torch.cat([ks[layer], k])
        vs[layer] = v if vs[layer] is None else torch.cat([vs[layer], v])
        return dense_attention(q, ks[layer], vs[layer], start)

    tokens, out, logits_seen = list(prompt), [], []
    new = tokens
    while len(out) < max_new_tokens:
        start = len(tokens) - len(new)
        positions = torch.arange(start, len(tokens))
        logits = model.forward(torch.tensor(new), positions,
                               lambda layer, q, k, v, s=start: attend(layer, q, k, v, s),
                               torch.tensor([len(new) - 1]))
        (token,) = sample(logits, [(rid, len(out))], temperature, seed)
        logits_seen.append(logits[0])
        out.append(token)
        tokens.append(token)
        new = [token]
    return out, logits_seen


@dataclass(frozen=True)
class CheckResult:
    """``requests`` compared, ``tokens`` compared, ``near_ties`` accepted, ``failures``: messages."""

    requests: int
    tokens: int
    near_ties: int
    failures: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failures


def check_against_dense(model: TinyLlama, requests: list, max_tokens: int | None = None, tol: float = 1e-3,
                        temperature: float = 0.0, seed: int = 0) -> CheckResult:
    """Compare the first ``max_tokens`` output tokens (all when None) of each finished ``Request`` with the
    dense loop's, by the rule in this module's docstring."""
    compared = ties = 0
    failures = []
    for r in requests:
        n = len(r.output) if max_tokens is None else min(max_tokens, len(r.output))
        want, logits = dense_generate(model, r.prompt, n, r.rid, temperature, seed)
        for i, (got, expect) in enumerate(zip(r.output[:n], want)):
            compared += 1
            if got == expect:
                continue
            gap = float(logits[i].max() - logits[i][got])
            if gap <= tol:
                ties += 1
            else:
                failures.append(f"request {r.rid}: output token {i} is {got}, the dense loop's {expect} "
                                f"(logit gap {gap:.3g} > tol {tol:g})")
            break
    return CheckResult(len(requests), compared, ties, tuple(failures))
