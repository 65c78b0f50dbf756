"""Does a sampler draw from the target's distribution? A check on its outputs that needs no second sample.

Under exact sampling from the target's (processed) distribution p_t at each position, d_t = log p_t(x_t)
+ H(p_t) has mean 0 given the past, and variance v_t = Var_{x ~ p_t}[log p_t(x)]. Over many sampled
tokens, Z = sum d_t / sqrt(sum v_t) is about N(0, 1) (a martingale central limit). A sampler that leans
toward its draft's tokens, or away from the target's, moves Z far from 0; the bench reports Z per
method for sampling runs (``metrics.fidelity_z``).
"""

from __future__ import annotations

import torch

from .sampling import probs_from_logits


@torch.inference_mode()
def output_terms(target, prompt_ids: list[int], out: list[int], sp) -> dict:
    """The sums behind Z for one sampled output (the target scores prompt + output in one forward);
    {} for greedy, for penalties or grammars (their processed distribution depends on state this check
    does not rebuild) and for an empty output. Tokens the processed distribution cannot produce (a
    top-k / top-p boundary moved by numerics) are counted apart, not scored."""
    if sp.greedy or sp.processed or not out or not prompt_ids:
        return {}
    rows = target.new_rows()
    rows.add_rows([prompt_ids[:-1]])
    logits = rows.forward([[prompt_ids[-1]] + out[:-1]])[0]
    p = probs_from_logits(logits, sp)
    lp = torch.log(p)
    plp = torch.where(p > 0, p * lp, 0.0)
    H = -plp.sum(-1)
    var = torch.where(p > 0, plp * lp, 0.0).sum(-1) - H * H
    lx = lp[torch.arange(len(out), device=lp.device), torch.tensor(out, device=lp.device)]
    ok = torch.isfinite(lx)
    return {
        "fid_sum": float((lx + H)[ok].sum()),
        "fid_var": float(var[ok].sum()),
        "fid_tokens": int(ok.sum()),
        "fid_impossible": int((~ok).sum()),
    }
