"""Function keys: a hooked function's calls keyed like its graph node, in module_keys, probes and dumps.

References: the keys of the atomic nodes of a trace, plain torch hooks on the module that reads the
attention's output (o_proj), the original function called by the test on the dumped inputs (and
autograd through it for the gradients), and identity (``is``) of the objects put back.
"""

from __future__ import annotations

import io
import threading
import types

import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.patching import call_dispatch_active, patched_functions

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

ATTN = "transformers.models.llama.modeling_llama.eager_attention_forward"
ORIGINAL = types.SimpleNamespace(attn=modeling_llama.eager_attention_forward)  # not a module global
LAYERS, HEADS, HEAD_DIM, TOKENS = 2, 4, 8, 6
KEYS = [f"model.layers.{i}.self_attn.eager_attention_forward" for i in range(LAYERS)]
WRAPPED = [f"lm.{k}" for k in KEYS]  # the keys inside Logits


class Logits(nn.Module):
    """The LM returning its logits tensor: the root's backward hook needs a tensor output."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits


def tiny_llama() -> tuple[nn.Module, torch.Tensor]:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), torch.randint(0, 64, (1, TOKENS))


def originals_back() -> None:
    assert vars(modeling_llama)["eager_attention_forward"] is ORIGINAL.attn
    assert patched_functions() == [] and not call_dispatch_active()


def o_proj_inputs(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """What each layer's o_proj receives (the attention output, reshaped), seen by plain torch hooks."""
    seen: list[torch.Tensor] = []
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- keys -------------------------------------------------------------------------------------------
def test_module_keys_with_inputs_list_the_function_keys_of_the_traced_graph_before_their_module() -> None:
    model, ids = tiny_llama()
    assert fwdtrace.module_keys(model) == list(fwdtrace.instrument.keys.key2module(model))  # no inputs: modules only
    fwdtrace.register_atomic(ATTN)
    keys = fwdtrace.module_keys(model, ids)
    originals_back()
    with torch.no_grad():
        graph = fwdtrace.trace(model, ids)
    nodes = [n.module_key for n in graph.nodes if n.attrs.get("atomic") and n.kind == "function"]
    assert nodes == KEYS
    assert [k for k in keys if k.endswith(".eager_attention_forward")] == KEYS
    assert [k for k in keys if not k.endswith(".eager_attention_forward")] == fwdtrace.module_keys(model)
    for i, key in enumerate(KEYS):  # after the attention's children, before the attention's own key
        assert keys.index(f"model.layers.{i}.self_attn.o_proj.Linear") < keys.index(key)
        assert keys.index(key) + 1 == keys.index(f"model.layers.{i}.self_attn.LlamaAttention")
    originals_back()


def test_a_mistyped_function_key_is_an_error_naming_the_closest_function_key() -> None:
    model, _ = tiny_llama()
    fwdtrace.register_atomic(ATTN)
    with fwdtrace.Probe(model) as probe:
        with pytest.raises(FwdtraceError, match=(
            r"^Probe expected a module key or path, a glob or a class of LlamaForCausalLM, got "
            r"'model.layers.1.self_attn.eager_attention_foward', which matches no key or path; "
            r"closest keys: 'model.layers.1.self_attn.eager_attention_forward'"
        )):
            probe.print_io("model.layers.1.self_attn.eager_attention_foward")
        with pytest.raises(FwdtraceError, match=r"^Probe expected a module key.*, got '\*.eager_attention'"):
            probe.print_io("*.eager_attention")
    originals_back()


def test_selectors_by_key_glob_path_and_function_object_name_the_same_sites() -> None:
    model, _ = tiny_llama()
    probe = fwdtrace.Probe(model)
    by_object = probe.select(ORIGINAL.attn)  # not registered: the function itself names all its keys
    assert set(KEYS) <= set(by_object) and len(by_object) == len(probe.keys)
    fwdtrace.register_atomic(ATTN)
    assert list(probe.select(KEYS[1])) == [KEYS[1]]
    assert set(probe.select("model.layers.*.self_attn.eager_attention_forward")) == set(KEYS)
    assert set(probe.select(ATTN)) == set(by_object)
    assert "model.layers.0.self_attn.o_proj.Linear" in probe.select("model.layers.0.self_attn.*")
    assert probe.weight_stats("model.layers.0.self_attn.*").keys() == {
        f"model.layers.0.self_attn.{p}_proj.Linear" for p in "qkvo"}  # function keys hold no weights
    originals_back()


# -- probes -----------------------------------------------------------------------------------------
def test_probe_shapes_and_print_io_see_each_layers_attention_call() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ATTN)
    with fwdtrace.Probe(model) as probe:
        shapes = probe.shapes(ids)
        out = io.StringIO()
        probe.print_io("model.layers.*.self_attn.eager_attention_forward", file=out)
        with torch.no_grad():
            model(ids)
    originals_back()
    order = list(shapes)
    for i, key in enumerate(KEYS):
        assert shapes[key]["output_shape"] == [[1, TOKENS, HEADS, HEAD_DIM], [1, HEADS, TOKENS, TOKENS]]
        assert order.index(key) < order.index(f"model.layers.{i}.self_attn.o_proj.Linear")
    text = out.getvalue()
    assert [line for line in text.splitlines() if "forward call" in line] == [f"{k} forward call 0" for k in KEYS]
    assert text.count("output0 float32[1, 6, 4, 8]") == LAYERS


def test_replace_output_on_a_function_key_changes_exactly_what_a_plain_hook_on_o_proj_changes() -> None:
    model, ids = tiny_llama()
    reference_inputs = o_proj_inputs(model, ids)
    # The reference: layer 1's o_proj fed zeros by a plain torch pre-hook.
    handle = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
    with torch.no_grad():
        expected = model(ids).logits
    handle.remove()
    fwdtrace.register_atomic(ATTN)
    with fwdtrace.Probe(model) as probe:
        calls: list[nn.Module] = []

        def zero(module: nn.Module, inputs: tuple, output: tuple) -> tuple:
            calls.append(module)
            return (torch.zeros_like(output[0]), output[1])

        probe.replace_output(KEYS[1], zero)
        seen = o_proj_inputs(model, ids)
        with torch.no_grad():
            got = model(ids).logits
    originals_back()
    assert calls == [model.model.layers[1].self_attn] * 2  # the calling module, once per forward
    torch.testing.assert_close(seen[0], reference_inputs[0])  # layer 0 untouched
    assert not seen[1].any()
    torch.testing.assert_close(got, expected)


def test_replace_grad_and_print_grads_on_a_function_key_match_autograd_through_the_original() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ATTN)
    captured: dict[str, tuple] = {}
    with fwdtrace.Probe(model) as probe:
        probe.replace_input(KEYS[0], lambda m, inputs, _: captured.setdefault("inputs", inputs) and None)
        probe.replace_grad(KEYS[0], lambda m, gin, gout: captured.setdefault("grads", (gin, gout)) and None)
        out = io.StringIO()
        probe.print_grads(KEYS[0], file=out)
        grad_o_proj: list[torch.Tensor] = []
        h = model.model.layers[0].self_attn.o_proj.register_full_backward_hook(
            lambda m, gi, go: grad_o_proj.append(gi[0]))
        model(ids).logits.sum().backward()
        h.remove()
    originals_back()
    grad_input, grad_output = captured["grads"]
    # grad_output: what o_proj passed back to its input, reshaped to the attention's output
    torch.testing.assert_close(grad_output[0], grad_o_proj[0].reshape(1, TOKENS, HEADS, HEAD_DIM))
    # grad_input: autograd through the original function on the same inputs and the same output grads
    module, q, k, v, mask = captured["inputs"][:5]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out = ORIGINAL.attn(module, *leaves, mask, scaling=module.scaling, dropout=0.0)
    grads = torch.autograd.grad(ref_out[0], leaves, grad_output[0])
    assert grad_input[0] is None  # the module argument
    for got, want in zip(grad_input[1:4], grads, strict=True):
        torch.testing.assert_close(got, want)
    assert "model.layers.0.self_attn.eager_attention_forward backward call 0" in out.getvalue()


# -- dumps ------------------------------------------------------------------------------------------
def dump(model: nn.Module, ids: torch.Tensor, directory: str, grads: bool = True) -> dict:
    with fwdtrace.Dumper(directory) as dumper:
        dumper.register(model, grads=grads)
        out = model(ids)
        if grads:
            out.sum().backward()
    return fwdtrace.read_dump(dumper.paths[0], show=False, values=True)


def test_a_dump_records_each_attention_call_as_its_own_group_equal_to_the_original_function(tmp_path) -> None:
    lm, ids = tiny_llama()
    model = Logits(lm)
    reference_inputs = o_proj_inputs(lm, ids)
    grad_o_proj: list[torch.Tensor] = []
    for layer in lm.model.layers:
        layer.self_attn.o_proj.register_full_backward_hook(lambda m, gi, go: grad_o_proj.insert(0, gi[0]))
    fwdtrace.register_atomic(ATTN)
    tree = dump(model, ids, str(tmp_path))
    originals_back()
    assert tree["status"] == "complete"
    groups = [g for g in tree["groups"].values() if g["attrs"].get("function") == ATTN]
    assert [g["attrs"]["module_key"] for g in groups] == WRAPPED
    names = list(tree["groups"])
    for i, g in enumerate(groups):
        attrs, data = g["attrs"], {k: v["value"] for k, v in g["datasets"].items()}
        assert attrs["module_path"] == f"lm.model.layers.{i}.self_attn" and attrs["call_index"] == 0
        name = next(n for n, v in tree["groups"].items() if v is g)
        assert name.endswith("_eager_attention_forward")
        assert names.index(name) < names.index(next(n for n, v in tree["groups"].items()
                                                     if v["attrs"]["module_key"] == f"lm.model.layers.{i}.self_attn.o_proj.Linear"))
        # forward: the output is what o_proj reads (plain hook), and what the original gives on the dumped inputs
        torch.testing.assert_close(data["output0"].reshape(1, TOKENS, -1), reference_inputs[i])
        attn = lm.model.layers[i].self_attn
        q, k, v, mask = (data[f"input{j}"].requires_grad_(j < 3) for j in range(4))
        out, weights = ORIGINAL.attn(attn, q, k, v, mask, scaling=attn.scaling, dropout=0.0)
        torch.testing.assert_close(out, data["output0"])
        torch.testing.assert_close(weights, data["output1"])
        # backward: grad_output0 is what o_proj passed back; grad_input0..2 are autograd's through the original
        torch.testing.assert_close(data["grad_output0"].reshape(1, TOKENS, -1), grad_o_proj[i])
        want = torch.autograd.grad(out, (q, k, v), data["grad_output0"])
        for j in range(3):
            torch.testing.assert_close(data[f"grad_input{j}"], want[j])


def test_compare_dumps_names_the_attention_call_that_differs(tmp_path) -> None:
    lm, ids = tiny_llama()
    model = Logits(lm)
    fwdtrace.register_atomic(ATTN)
    a = dump(model, ids, str(tmp_path / "a"), grads=False)
    with fwdtrace.Probe(model) as probe:
        probe.replace_output(WRAPPED[1], lambda m, i, o: (o[0] * 1.5, o[1]))
        b = dump(model, ids, str(tmp_path / "b"), grads=False)
    originals_back()
    paths = sorted(tmp_path.glob("*/*.hdf5"))
    assert a["groups"].keys() == b["groups"].keys()
    same = fwdtrace.compare_dumps(paths[0], paths[0])
    assert same.equal and {r.key for r in same.rows} >= set(WRAPPED)
    report = fwdtrace.compare_dumps(*paths)
    first = next(r for r in report.rows if not r.allclose)
    assert (first.key, first.name) == (WRAPPED[1], "output0")
    assert all(r.allclose for r in report.rows if r.key == WRAPPED[0])


def test_a_function_call_that_raises_makes_the_dump_incomplete_naming_its_group(tmp_path) -> None:
    lm, ids = tiny_llama()
    fwdtrace.register_atomic(ATTN)
    with fwdtrace.Probe(lm) as probe:
        probe.replace_input(KEYS[1], lambda m, inputs, _: (m, inputs[1], inputs[2][..., :1], *inputs[3:]))
        model = Logits(lm)
        with pytest.raises(RuntimeError), fwdtrace.Dumper(tmp_path) as dumper:
            dumper.register(model, grads=False)
            model(ids)
    originals_back()
    status = fwdtrace.read_dump(next(tmp_path.glob("*.hdf5")), show=False)["status"]
    assert status.startswith("incomplete: ") and "the forward raised in " in status
    assert "_eager_attention_forward" in status.split("the forward raised in ", 1)[1].split(":")[0]


def test_function_key_hooks_run_in_other_threads_each_keyed_by_its_own_threads_module() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ATTN)
    seen: list[tuple[str, int]] = []
    with fwdtrace.Probe(model) as probe:
        probe.running_stats("model.layers.*.self_attn.eager_attention_forward")
        probe.replace_output("*.eager_attention_forward", lambda m, i, o: seen.append(
            (m.layer_idx, threading.get_ident())) and None)

        def run() -> None:
            with torch.no_grad():
                model(ids)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = probe.handles[0].stats  # type: ignore[attr-defined]
    originals_back()
    assert sorted(layer for layer, _ in seen) == [0, 0, 0, 1, 1, 1]
    assert {ident for _, ident in seen} == {t.ident for t in threads}
    assert set(stats) == set(KEYS) and all(s.count == 3 * (TOKENS * HEADS * HEAD_DIM + HEADS * TOKENS * TOKENS)
                                           for s in stats.values())
