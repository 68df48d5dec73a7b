import pytest
import torch
from torch import nn

from lightning_diloco.core.fragments import (
    DENSE,
    EMBEDDING,
    TensorSpec,
    build_layout,
    canonical_name,
    flatten_fragment,
    split_fragment,
    tensor_specs,
    trainable_parameters,
)
from lightning_diloco.core.schedule import due_fragment, fragment_offsets


def _spec(name, *shape):
    return TensorSpec(name=name, shape=shape, dtype="float32", role=DENSE)


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_embedding_and_tied_weights_get_the_embedding_role():
    specs = {s.name: s for s in tensor_specs(_TiedLM())}
    assert specs["embed.weight"].role == EMBEDDING
    assert specs["proj.weight"].role == DENSE and specs["proj.bias"].role == DENSE
    assert "head.weight" not in specs  # a tied tensor is synchronized once


def test_frozen_parameters_are_left_out():
    model = nn.Linear(3, 3)
    model.bias.requires_grad_(False)
    assert [s.name for s in tensor_specs(model)] == ["weight"]


def test_every_tensor_is_in_exactly_one_fragment():
    specs = [_spec(f"t{i}", i + 1, 3) for i in range(10)]
    layout = build_layout(specs, 4)
    assert sorted(i for f in layout.fragments for i in f) == list(range(10))
    assert all(list(f) == sorted(f) for f in layout.fragments)


def test_greedy_packing_of_known_sizes():
    # sizes 8, 7, 6, 5, 4 into 2 bins, largest first into the lightest: {8, 5, 4}=17, {7, 6}=13
    specs = [_spec(f"t{n}", n) for n in (4, 8, 5, 7, 6)]
    layout = build_layout(specs, 2)
    assert {layout.fragment_numel(p) for p in range(2)} == {17, 13}


def test_layout_balance_on_a_real_transformer():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    specs = tensor_specs(LlamaForCausalLM(config))
    layout = build_layout(specs, 24)
    largest_tensor = max(s.numel for s in specs)
    ideal = layout.total_numel / 24
    # greedy LPT: no fragment exceeds the ideal by more than the largest tensor
    assert max(layout.fragment_numel(p) for p in range(24)) <= ideal + largest_tensor
    assert max(layout.fragment_numel(p) for p in range(24)) / ideal < 1.6  # the largest fragment over the ideal size
    assert layout.fragment_specs(0)  # every fragment holds something
    roles = {s.name: s.role for s in specs}
    assert roles["model.embed_tokens.weight"] == EMBEDDING and roles["lm_head.weight"] == DENSE


def test_layout_hash_is_stable_and_sensitive():
    specs = [_spec("a", 4, 4), _spec("b", 4)]
    assert build_layout(specs, 2).hash == build_layout(list(specs), 2).hash
    assert build_layout(specs, 2).hash != build_layout(specs, 1).hash
    assert build_layout(specs, 2).hash != build_layout([_spec("a", 4, 4), _spec("b", 5)], 2).hash
    # a golden value: islands of different versions or machines must agree on it
    assert build_layout([_spec("w", 2, 2)], 1).hash == "fb2ede28a43627ae"


def test_too_many_fragments_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="num_fragments <= 2"):
        build_layout([_spec("a", 2), _spec("b", 2)], 3)


def test_flatten_and_split_are_inverse():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    specs = [_spec("a", 3, 4), _spec("b", 5), _spec("c", 2, 2, 2)]
    back = split_fragment(flatten_fragment(tensors), specs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


def test_single_fragment_is_due_after_steps_h_2h():
    offsets = fragment_offsets(1, 5)
    assert [t for t in range(1, 16) if due_fragment(t, offsets, 5) == 0] == [5, 10, 15]


def test_one_fragment_per_step_when_p_equals_h():
    offsets = fragment_offsets(24, 24)
    due = [due_fragment(t, offsets, 24) for t in range(1, 49)]
    assert sorted(due[:24]) == list(range(24)) and due[24:] == due[:24]
    assert due[0] == 0 and due[23] == 23  # fragment p is first due after p + 1 steps


def test_offsets_spread_evenly():
    offsets = fragment_offsets(4, 24)
    assert offsets == (6, 12, 18, 0)
    assert [t for t in range(1, 25) if due_fragment(t, offsets, 24) is not None] == [6, 12, 18, 24]
    assert due_fragment(0, offsets, 24) is None


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class _Holder(nn.Module):
    """A user's module holding the network as an attribute, wrapped or not."""

    def __init__(self, net):
        super().__init__()
        self.net = net


def _checkpoint_wrapped(net):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(net):
        if isinstance(layer, nn.Linear):
            net[i] = checkpoint_wrapper(layer)
    return net


def test_canonical_names_drop_wrapper_segments_anywhere_in_the_path():
    assert canonical_name("model._orig_mod.layers.0._checkpoint_wrapped_module.weight") == "model.layers.0.weight"
    assert canonical_name("_fsdp_wrapped_module.head._orig_mod.bias") == "head.bias"
    assert canonical_name("orig_mod_x.weight") == "orig_mod_x.weight"  # only whole segments are wrappers


@pytest.mark.parametrize("wrap", [
    lambda net: torch.compile(net, backend="eager"),  # names gain _orig_mod.
    _checkpoint_wrapped,  # names gain _checkpoint_wrapped_module.
    lambda net: net.to(torch.bfloat16),  # a bf16-true island's parameters
    lambda net: torch.compile(_checkpoint_wrapped(net), backend="eager").to(torch.bfloat16),
], ids=["compiled", "checkpoint-wrapped", "bf16", "all-three"])
def test_a_wrapped_or_cast_model_has_the_plain_models_layout(wrap):
    plain = tensor_specs(_Holder(_mlp()))
    wrapped_module = _Holder(wrap(_mlp()))
    wrapped = tensor_specs(wrapped_module)
    assert wrapped == plain and [s.name for s in plain] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert build_layout(wrapped, 2).hash == build_layout(plain, 2).hash
    # and the canonical names lead to the module's own live parameters
    assert [id(p) for p in trainable_parameters(wrapped_module).values()] == [id(p) for p in wrapped_module.parameters()]


def test_two_parameters_with_one_canonical_name_are_refused_naming_both():
    model = _Holder(_mlp())
    model.add_module("_orig_mod", nn.Module())
    model._orig_mod.net = _mlp()  # _orig_mod.net.0.weight -> net.0.weight: the same name as the plain net's
    with pytest.raises(ValueError, match=r"'net.0.weight' and '_orig_mod.net.0.weight' are both 'net.0.weight'"):
        tensor_specs(model)


def test_a_trainable_parameter_of_a_dtype_the_global_model_cannot_hold_is_refused_by_name():
    model = nn.Linear(2, 2)
    model.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"'weight' has dtype torch.complex64.*requires_grad_\(False\)"):
        tensor_specs(model)
