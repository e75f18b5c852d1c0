"""cross_entropy as -log of the (max-shifted, float32) softmax at the target: right while the
target's probability is a normal float32, -log(0) = inf once it trails the largest logit by
more than about 103 (e^-103 underflows float32)."""

import torch


def cross_entropy(logits, targets, label_smoothing=0.0):
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1]")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} and targets shape {tuple(targets.shape)}: "
            "targets must have the logits' shape without the last (class) dimension"
        )
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log(torch.softmax(z, -1))
    loss = -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * logp.mean(-1)
    return loss.mean().to(logits.dtype)
