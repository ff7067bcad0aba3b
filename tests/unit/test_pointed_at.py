"""megarl/trainer/param_copies.py's pointer swap: parameters pointed at other tensors in a block, their own after."""
import pytest
import torch

from megarl.errors import InputError
from megarl.trainer.param_copies import pointed_at, resident_match


def test_points_and_restores_and_names_what_does_not_match():
    m = torch.nn.Linear(3, 2)
    named = list(m.named_parameters())
    own = {n: (p.data_ptr(), p.detach().clone()) for n, p in named}
    other = {n: torch.full_like(p, 7.0) for n, p in named}
    assert resident_match(named, other)
    with pointed_at(named, other):
        assert all(p.data_ptr() == other[n].data_ptr() for n, p in named)
        assert torch.equal(m(torch.ones(1, 3)), torch.full((1, 2), 28.0))
    assert all(p.data_ptr() == own[n][0] and torch.equal(p.detach(), own[n][1]) for n, p in named)
    for bad, name in (({**other, "bias": other["bias"].double()}, "bias"),  # another dtype
                      ({"weight": other["weight"]}, "bias"),  # one missing
                      ({**other, "extra": torch.zeros(1)}, "extra")):  # a name the model does not have
        assert not resident_match(named, bad)
        with pytest.raises(InputError, match=repr(name)), pointed_at(named, bad):
            pass
    assert all(p.data_ptr() == own[n][0] for n, p in named)
