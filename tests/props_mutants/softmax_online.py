"""softmax over chunks of 1024 with a running max, which forgets to rescale the running sum when
a later chunk raises the max (an online softmax written for long rows). Right on every row of up to
1024 entries; on longer rows the sum mixes exponentials taken against different maxima."""

import torch

CHUNK = 1024


def softmax(x, dim=-1):
    xt = x.movedim(dim, -1)
    xf = xt.to(torch.promote_types(x.dtype, torch.float32))
    m = torch.full(xf.shape[:-1] + (1,), float("-inf"), dtype=xf.dtype)
    s = torch.zeros_like(m)
    for start in range(0, xf.shape[-1], CHUNK):
        part = xf[..., start:start + CHUNK]
        m = torch.maximum(m, part.amax(-1, keepdim=True))
        s = s + torch.exp(part - m).sum(-1, keepdim=True)  # the old s is not multiplied by exp(m_old - m)
    return (torch.exp(xf - m) / s).to(x.dtype).movedim(-1, dim)
