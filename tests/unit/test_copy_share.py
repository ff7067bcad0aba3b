"""recovery/_reference.py's copy_share: how the verifier tells an anchor copied from logp_behav from a forward.

Only tokens where the reference differs from logp_behav in some bit can tell the two apart; of those, a copy
carries logp_behav's exact bits. The check compares bits whatever the dtype the engines sampled in, so the e2e
negative control (`--negative-control anchor_is_behav`) runs in fp32 alone, where only the bits give the copy away.
"""
from types import SimpleNamespace

import torch

from megarl.types import NO_VERSION
from recovery._reference import copy_share

# one row of 5 targets: the first is prompt (no loss), the last has no version (a tool's tokens), so the policy
# tokens are 1, 2 and 3
BATCH = SimpleNamespace(loss_mask=torch.tensor([[0, 1, 1, 1, 1]]),
                        versions=torch.tensor([[NO_VERSION, 1, 1, 1, NO_VERSION]]),
                        logp_behav=torch.tensor([[-1.0, -0.5, -0.25, -2.0, -3.0]]))
#: the trainer's log-probs at each token's version: equal to logp_behav's bits at policy token 1, different at 2
#: (by one float32 ulp) and 3; different too at 0 and 4, which are not the policy's and do not count
TRUTH = torch.tensor([[-1.5, -0.5, torch.nextafter(torch.tensor(-0.25), torch.tensor(0.0)).item(), -2.1, -3.5]])


def test_a_copy_of_logp_behav_carries_its_bits_on_every_telling_token():
    assert copy_share(BATCH.logp_behav.clone(), TRUTH, BATCH) == (2.0, 2.0)


def test_a_forward_differs_from_logp_behav_where_the_tokens_tell():
    assert copy_share(TRUTH.clone(), TRUTH, BATCH) == (0.0, 2.0)
    # a forward a hair off the truth is no copy either
    assert copy_share(TRUTH + 1e-6, TRUTH, BATCH) == (0.0, 2.0)


def test_the_check_is_blind_to_the_dtype_the_copy_is_held_in():
    # logp_behav's values are exact in bf16: a bf16 copy has the same bits once widened
    assert copy_share(BATCH.logp_behav.to(torch.bfloat16), TRUTH, BATCH) == (2.0, 2.0)
    half = BATCH.logp_behav.clone()
    half[0, 3] = -2.1  # copied at token 2 only
    assert copy_share(half, TRUTH, BATCH) == (1.0, 2.0)


def test_tokens_where_the_reference_equals_logp_behav_cannot_tell():
    assert copy_share(BATCH.logp_behav.clone(), BATCH.logp_behav.clone(), BATCH) == (0.0, 0.0)
