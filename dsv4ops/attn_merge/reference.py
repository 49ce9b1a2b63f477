"""Reference kernel of `dsv4::attn_merge`: the sink attention of a query over keys split into R
shards, from each shard's partial: partials[r] = the shard's attention output normalized over its
own keys without the sink, lse[r] = ln sum_j e^(l_j) over them (-inf: the shard had no key; then its
partial is not read). With M = max(max_r lse[r], sink):

    out = sum_r e^(lse[r] - M) partials[r] / (sum_r e^(lse[r] - M) + e^(sink - M))

which is o = sum_j e^(l_j - M) k_j / (sum_j e^(l_j - M) + e^(sink - M)) over every shard's keys (spec
3.5): the sink counted once. A query no shard has a key for gets 0. In fp32 (fp64 for fp64
partials); out in its dtype."""

import torch
from torch import Tensor

from dsv4ops.reference.functional import acc_dtype


def attn_merge(partials: Tensor, lse: Tensor, sinks: Tensor, out: Tensor) -> None:
    acc = acc_dtype(partials.dtype)
    lse = lse.to(acc)
    sink = sinks.to(acc)[None, :].expand(lse.shape[1:])  # [T, H]
    m = torch.maximum(lse.amax(0), sink)
    w = torch.exp(lse - m)  # [R, T, H]; 0 for a shard without keys
    den = w.sum(0) + torch.exp(sink - m)
    has = (lse > float("-inf"))[..., None]
    num = torch.where(has, w[..., None] * partials.to(acc), 0.0).sum(0)  # an empty shard's row is not read
    out.copy_((num / den[..., None]).to(out.dtype))
