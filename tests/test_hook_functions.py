"""@hook_forward / register_atomic on functions and methods: transformers' attention and rotary embedding
as one node each, callbacks on their real tensors, the originals back whatever happens.

References: the original functions called by the test itself, plain torch forward hooks, the
model's configuration (one call per layer), and identity (``is``) of the objects put back.
"""

from __future__ import annotations

import random
import re
import signal
import sys
import threading
import time
import types
from typing import Any

import networkx as nx
import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.patching import patched_functions
from fwdtrace.registry import REGISTRY

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

ROPE = "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"
LLAMA_ATTN = "transformers.models.llama.modeling_llama.eager_attention_forward"
GPT2_ATTN = "transformers.models.gpt2.modeling_gpt2.eager_attention_forward"
# Not module globals (nor a dict): those would be other holders of the functions, rightly warned about.
ORIGINAL = types.SimpleNamespace(
    rope=modeling_llama.apply_rotary_pos_emb,
    llama_attn=modeling_llama.eager_attention_forward,
    gpt2_attn=modeling_gpt2.eager_attention_forward,
)
LAYERS = 2


def originals_back() -> None:
    assert vars(modeling_llama)["apply_rotary_pos_emb"] is ORIGINAL.rope
    assert vars(modeling_llama)["eager_attention_forward"] is ORIGINAL.llama_attn
    assert vars(modeling_gpt2)["eager_attention_forward"] is ORIGINAL.gpt2_attn
    assert patched_functions() == []


def tiny_llama() -> tuple[nn.Module, torch.Tensor]:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager", use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), torch.randint(0, 64, (1, 6))


def tiny_gpt2() -> tuple[nn.Module, torch.Tensor]:
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=32, attn_implementation="eager", use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 64, (1, 6))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# -- one node per call, wired to its neighbours -----------------------------------------------------
def test_llama_rope_and_attention_are_one_node_per_layer_between_the_right_neighbours() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ROPE)
    fwdtrace.register_atomic(LLAMA_ATTN)
    with torch.no_grad():
        graph = fwdtrace.trace(model, ids)
    originals_back()
    ropes, attns = graph.find(target=ROPE), graph.find(target=LLAMA_ATTN)
    assert [n.module_path for n in ropes] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert [n.module_path for n in attns] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert {(n.kind, n.class_name) for n in ropes + attns} == {("function", "apply_rotary_pos_emb"),
                                                                ("function", "eager_attention_forward")}
    assert ropes[0].module_key == "model.layers.0.self_attn.apply_rotary_pos_emb"
    # The inside is hidden: rotate_half's neg/cat and attention's matmul/softmax are not in the graph.
    inner = {"torch.Tensor.neg", "torch.cat", "torch.matmul", "torch.nn.functional.softmax"}
    assert not [n.target for n in graph.nodes if n.target in inner and n.module_path.endswith("self_attn")]
    assert graph.find(target="torch.cat", module_path="model.rotary_emb")  # what is not inside them stays

    g = graph.to_networkx()
    by_path = {n.module_path: n.id for n in graph.find(kind="module")}
    for i, (rope, attn) in enumerate(zip(ropes, attns, strict=True)):
        layer = f"model.layers.{i}.self_attn"
        assert len(rope.inputs) == 4 and len(rope.outputs) == 2  # q, k, cos, sin -> q, k rotated
        assert g.has_edge(rope.id, attn.id)  # rotated q and k go straight into attention
        assert {e[2]["obj_id"] for e in g.out_edges(rope.id, data=True)} == {r.obj_id for r in rope.outputs}
        assert nx.has_path(g, by_path[f"{layer}.q_proj"], rope.id)
        assert nx.has_path(g, by_path[f"{layer}.k_proj"], rope.id)
        assert not nx.has_path(g, by_path[f"{layer}.v_proj"], rope.id)  # v is not rotated ...
        assert nx.has_path(g, by_path[f"{layer}.v_proj"], attn.id)  # ... it goes to attention alone
        rotary = {n.id for n in graph.nodes if n.module_path == "model.rotary_emb"}
        assert any(p in rotary for p in g.predecessors(rope.id))  # cos and sin
        # attention -> (reshape) -> o_proj of the same layer, and only function nodes between
        between = nx.shortest_path(g, attn.id, by_path[f"{layer}.o_proj"])[1:-1]
        assert all(graph.nodes[j].kind == "function" and graph.nodes[j].module_path == layer for j in between)
        if i + 1 < LAYERS:  # nothing from one layer's attention skips into the next layer's
            assert not g.has_edge(attn.id, attns[i + 1].id) and not g.has_edge(rope.id, ropes[i + 1].id)


def test_gpt2_attention_is_one_node_per_layer_and_one_box_in_the_picture() -> None:
    model, ids = tiny_gpt2()
    fwdtrace.register_atomic(GPT2_ATTN)  # the README's one line
    with torch.no_grad():
        graph = fwdtrace.trace(model, ids)
    originals_back()
    attns = graph.find(target=GPT2_ATTN)
    assert [n.module_path for n in attns] == [f"transformer.h.{i}.attn" for i in range(LAYERS)]
    g = graph.to_networkx()
    path2ids: dict[str, list[int]] = {}
    for n in graph.nodes:
        path2ids.setdefault(n.module_path, []).append(n.id)
    for i, attn in enumerate(attns):
        layer = f"transformer.h.{i}.attn"
        assert len(attn.inputs) >= 3  # q, k, v (and the mask when there is one)
        # c_attn (Conv1D: a node, or the calls it makes) -> split -> attention -> merge -> c_proj
        assert nx.has_path(g, path2ids[f"{layer}.c_attn"][-1], attn.id)
        assert nx.has_path(g, attn.id, path2ids[f"{layer}.c_proj"][0])
        assert not nx.has_path(g, attn.id, path2ids[f"{layer}.c_attn"][-1])
    assert not graph.find(target="torch.matmul")
    source = graph.to_dot(None, collapse_repeats=False, fold_side=False, fold_loops=False).source
    assert len(re.findall(r'label="?eager_attention_forward"?[\s,\]]', source)) == LAYERS


# -- callbacks ------------------------------------------------------------------------------------
def test_callbacks_see_the_real_tensors_of_each_call() -> None:
    model, ids = tiny_llama()
    calls: list[tuple[tuple, dict, Any]] = []
    q_proj: list[torch.Tensor] = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: q_proj.append(o))

    @fwdtrace.hook_forward(ROPE)
    def seen(inputs: tuple, kwargs: dict, output: Any) -> None:
        calls.append((inputs, kwargs, output))

    with torch.no_grad():
        fwdtrace.trace(model, ids)
    handle.remove()
    assert len(calls) == LAYERS
    inputs, kwargs, output = calls[0]
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    torch.testing.assert_close(inputs[0], q_proj[0].view(1, 6, heads, head_dim).transpose(1, 2))
    for inputs, kwargs, output in calls:
        expected = ORIGINAL.rope(*inputs, **kwargs)  # the function itself, called by the test
        torch.testing.assert_close(output, expected, rtol=0, atol=0)
    originals_back()


def test_a_returned_output_replaces_the_functions_output_in_traces_probes_and_install() -> None:
    model, ids = tiny_gpt2()
    plain = logits(model, ids)
    zeroed = [m.attn.c_proj.register_forward_pre_hook(lambda m, args: (torch.zeros_like(args[0]),))
              for m in model.transformer.h]
    expected = logits(model, ids)  # reference: plain torch hooks zero what attention hands to c_proj
    for h in zeroed:
        h.remove()
    assert not torch.allclose(expected, plain)

    @fwdtrace.hook_forward(GPT2_ATTN)
    def silence(inputs: tuple, kwargs: dict, output: Any) -> Any:
        attn_output, weights = output
        return torch.zeros_like(attn_output), weights

    with torch.no_grad(), fwdtrace.Tracer():
        traced = model(ids).logits
    torch.testing.assert_close(traced, expected)
    torch.testing.assert_close(logits(model, ids), plain)  # no trace: nothing patched, nothing changes
    fwdtrace.install()
    try:
        torch.testing.assert_close(logits(model, ids), expected)
    finally:
        fwdtrace.uninstall()
    fwdtrace.remove_hook(silence)
    with fwdtrace.Probe(model) as probe:
        probe.hook_function(GPT2_ATTN, lambda inputs, kwargs, output: (output[0] * 0, output[1]))
        torch.testing.assert_close(logits(model, ids), expected)
    torch.testing.assert_close(logits(model, ids), plain)
    originals_back()


# -- the originals come back ---------------------------------------------------------------------
def test_originals_back_after_an_exception_in_the_function_and_in_a_callback() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ROPE)

    @fwdtrace.hook_forward(LLAMA_ATTN)
    def fail(inputs: tuple, kwargs: dict, output: Any) -> None:
        raise ValueError("callback failed")

    with pytest.raises(ValueError, match="callback failed"):
        fwdtrace.trace(model, ids)
    originals_back()
    fwdtrace.remove_hook(fail)
    with pytest.raises(RuntimeError) as info:  # cos/sin of the wrong size: the function itself raises
        fwdtrace.trace(model, ids, position_ids=torch.arange(40).unsqueeze(0))
    originals_back()
    assert any("apply_rotary_pos_emb" in note for note in getattr(info.value, "__notes__", []))


def test_300_ctrl_cs_leave_the_originals_and_surface_only_as_keyboard_interrupt() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ROPE)
    fwdtrace.register_atomic(LLAMA_ATTN)
    with torch.no_grad():
        reference = fwdtrace.trace(model, ids)
    armed = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    stop = threading.Event()
    main_id = threading.main_thread().ident
    assert main_id is not None and threading.current_thread() is threading.main_thread()

    def timer() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            time.sleep(rng.uniform(0.0, 0.003))
            signal.pthread_kill(main_id, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_sigint)
    thread = threading.Thread(target=timer, daemon=True)
    interrupted, finished, others = 0, 0, []
    try:
        thread.start()
        with torch.no_grad():
            for _ in range(300):
                try:
                    armed[0] = True
                    graph = fwdtrace.trace(model, ids)
                    armed[0] = False
                    finished += 1
                    assert graph == reference
                except KeyboardInterrupt:
                    interrupted += 1
                except BaseException as e:  # noqa: BLE001 - anything but KeyboardInterrupt fails
                    armed[0] = False
                    others.append(repr(e))
                originals_back()
    finally:
        armed[0] = False
        stop.set()
        thread.join(timeout=10)
        time.sleep(0.1)  # a signal in flight meets the disarmed handler
        signal.signal(signal.SIGINT, previous)
    assert others == []
    assert interrupted > 50, (interrupted, finished)
    with torch.no_grad():
        assert fwdtrace.trace(model, ids) == reference


def test_threads_tracing_at_once_each_record_only_their_own_calls() -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ROPE)
    seen_threads: list[str] = []

    @fwdtrace.hook_forward(LLAMA_ATTN)
    def note(inputs: tuple, kwargs: dict, output: Any) -> None:
        seen_threads.append(threading.current_thread().name)

    with torch.no_grad():
        reference = fwdtrace.trace(model, ids)
    seen_threads.clear()
    start = threading.Barrier(3)
    graphs: dict[str, list[Any]] = {}
    errors: list[str] = []

    def tracing(name: str) -> None:
        try:
            start.wait()
            with torch.no_grad():
                graphs[name] = [fwdtrace.trace(model, ids) for _ in range(3)]
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    def plain() -> None:
        start.wait()
        with torch.no_grad():
            for _ in range(3):
                model(ids)  # runs through the shared wrapper, in no trace: no callback, no node

    threads = [threading.Thread(target=tracing, args=(n,), name=n) for n in ("a", "b")]
    threads.append(threading.Thread(target=plain, name="plain"))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert all(g == reference for gs in graphs.values() for g in gs)  # nothing of the other threads' calls
    assert sorted(seen_threads) == ["a"] * 3 * LAYERS + ["b"] * 3 * LAYERS
    originals_back()


@pytest.mark.parametrize("first_out", ["probe", "trace"])
def test_a_probe_and_a_trace_sharing_one_function_leave_in_either_order(first_out: str) -> None:
    model, ids = tiny_llama()
    fwdtrace.register_atomic(ROPE)
    with torch.no_grad():
        reference = fwdtrace.trace(model, ids)
    probe_calls: list[int] = []
    probe = fwdtrace.Probe(model).__enter__()
    probe.hook_function(ROPE, lambda inputs, kwargs, output: probe_calls.append(1))
    tracer = fwdtrace.Tracer().__enter__()
    assert vars(modeling_llama)["apply_rotary_pos_emb"] is not ORIGINAL.rope
    with torch.no_grad():
        model(ids)
    users = {"probe": probe, "trace": tracer}
    first, second = users.pop(first_out), users.popitem()[1]
    first.__exit__(None, None, None)
    assert vars(modeling_llama)["apply_rotary_pos_emb"] is not ORIGINAL.rope  # the other one still uses it
    second.__exit__(None, None, None)
    originals_back()
    assert tracer.graph == reference and len(probe_calls) == LAYERS


# -- where patching cannot reach every call ---------------------------------------------------------
@pytest.fixture
def two_modules() -> Any:
    """``home`` defines ``f``; ``user`` did ``from home import f``."""
    home, user = types.ModuleType("fwdtrace_test_home"), types.ModuleType("fwdtrace_test_user")
    exec("import torch\ndef f(x):\n    return x * 2\n", home.__dict__)  # noqa: S102 - a test module's source
    home.f.__module__ = home.__name__
    user.f = home.f
    exec("def g(x):\n    return f(x) + 1\n", user.__dict__)  # noqa: S102
    sys.modules[home.__name__], sys.modules[user.__name__] = home, user
    yield home, user
    del sys.modules[home.__name__], sys.modules[user.__name__]


def test_a_function_imported_by_value_is_named_and_patched_everywhere_when_asked(two_modules: Any) -> None:
    home, user = two_modules
    original = home.f

    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return user.g(x)  # calls f through the user module's own global

    seen: list[int] = []
    with pytest.warns(UserWarning, match=r"imported by value into other modules.*: fwdtrace_test_user\.f \(everywhere=True"):
        fwdtrace.hook_forward(original)(lambda inputs, kwargs, output: seen.append(1))
    fwdtrace.trace(Model(), torch.ones(2))
    assert seen == []  # the warning was right: the user module's name runs the original
    fwdtrace.clear_hooks()
    fwdtrace.hook_forward(original, everywhere=True, atomic=True)(lambda inputs, kwargs, output: seen.append(1))
    graph = fwdtrace.trace(Model(), torch.ones(2))
    assert seen == [1] and [n.target for n in graph.find(kind="function")][0] == "fwdtrace_test_home.f"
    assert home.__dict__["f"] is original and user.__dict__["f"] is original
    del REGISTRY.functions["fwdtrace_test_home.f"]


def test_removing_a_functions_last_callback_unregisters_it_unless_it_is_atomic(two_modules: Any) -> None:
    home, user = two_modules
    del user.f  # f held by its module alone: nothing to warn about
    original = home.f

    class Double(nn.Module):  # looks f up on its module at each call: what patching replaces
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return home.f(x)

    model, x = nn.Sequential(Double()), torch.ones(2)
    during_trace: list[Any] = []
    model[0].register_forward_pre_hook(lambda m, a: during_trace.append(vars(home)["f"]))
    calls: list[int] = []

    def count(inputs: tuple, kwargs: dict, output: Any) -> None:
        calls.append(1)

    fwdtrace.hook_forward("fwdtrace_test_home.f")(count)
    assert fwdtrace.module_keys(model, x) == ["0.f", "0.Double", "Sequential"]
    fwdtrace.trace(model, x)
    assert calls == [1] and during_trace[-1] is not original  # patched while tracing, for the callback
    assert fwdtrace.remove_hook(count) == 1
    assert "fwdtrace_test_home.f" not in REGISTRY.functions
    assert fwdtrace.module_keys(model, x) == list(fwdtrace.instrument.keys.key2module(model))  # the modules alone
    with pytest.raises(FwdtraceError, match=r"got '\*\.f', which matches no key"):
        fwdtrace.Probe(model).select("*.f")
    fwdtrace.trace(model, x)
    assert calls == [1] and during_trace[-1] is original  # not patched: no one asks for it
    fwdtrace.register_atomic("fwdtrace_test_home.f")
    fwdtrace.hook_forward("fwdtrace_test_home.f")(count)
    assert fwdtrace.remove_hook(count) == 1
    assert fwdtrace.module_keys(model, x) == ["0.f", "0.Double", "Sequential"]  # atomic: still one node per call
    assert [n.target for n in fwdtrace.trace(model, x).find(kind="function")] == ["fwdtrace_test_home.f"]
    assert calls == [1] and vars(home)["f"] is original


def test_a_function_in_a_registry_dict_is_named() -> None:
    with pytest.warns(UserWarning, match=r"stored in registry dicts.*ALL_ATTENTION_FUNCTIONS\._global_mapping\['sdpa'\]"):
        fwdtrace.hook_forward("transformers.integrations.sdpa_attention.sdpa_attention_forward")


@torch.jit.script
def scripted_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize(("target", "reason"), [
    ("torch.nn.functional.scaled_dot_product_attention", "builtin"),
    (f"{__name__}.scripted_double", "torch.jit scripted function"),
])
def test_builtins_and_scripted_functions_are_named(target: str, reason: str) -> None:
    with pytest.warns(UserWarning, match=rf"^fwdtrace: hook_forward\(\) on .* cannot see every call: .*{reason}"):
        fwdtrace.hook_forward(target)


# -- methods ----------------------------------------------------------------------------------------
class Helper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x) + Helper.shift(x) + self.halve(x)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def shift(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @classmethod
    def halve(cls, x: torch.Tensor) -> torch.Tensor:
        return x / 2


class Child(Helper):
    pass


def test_methods_static_and_class_methods_are_patched_where_defined() -> None:
    before = {name: Helper.__dict__[name] for name in ("scale", "shift", "halve")}
    x = torch.tensor([1.0, 2.0])
    seen: list[tuple[str, Any]] = []
    fwdtrace.hook_forward(f"{__name__}.Child.scale", atomic=True)(lambda i, k, o: seen.append(("scale", i[0])))
    fwdtrace.hook_forward(Helper.shift, atomic=True)(lambda i, k, o: seen.append(("shift", i)))
    fwdtrace.hook_forward(Helper.halve, atomic=True)(lambda i, k, o: o * 0)  # classmethod, bound to the class
    model = Child()
    graph = fwdtrace.trace(model, x)
    assert [n.target for n in graph.find(kind="function") if n.attrs.get("atomic")] == [
        f"{__name__}.Helper.scale", f"{__name__}.Helper.shift", f"{__name__}.Helper.halve"]
    assert seen[0] == ("scale", model) and len(seen[1][1]) == 1  # self for a method, none for a static one
    torch.testing.assert_close(graph.nodes[-1].inputs[0].shape, (2,))
    with fwdtrace.Tracer():
        out = model(x)
    torch.testing.assert_close(out, x * 3 + x + 1)  # the classmethod's output replaced by zeros
    for name, obj in before.items():
        assert Helper.__dict__[name] is obj and name not in Child.__dict__


BAD_FUNCTION_TARGETS = [
    (lambda x: x, r"^hook_forward\(\) could not find where .*<lambda> lives \(a local function or a lambda\); pass its dotted path"),
    (Helper().scale, r"^hook_forward\(\) expected .* got the bound method Helper\.scale of an instance"),
]


@pytest.mark.parametrize(("target", "message"), BAD_FUNCTION_TARGETS)
def test_bad_function_targets_say_what_to_pass(target: Any, message: str) -> None:
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.hook_forward(target)
    assert patched_functions() == []


# -- check_onnx over atomic functions ---------------------------------------------------------------
def test_check_onnx_compares_atomic_functions_through_what_they_compute() -> None:
    model, ids = tiny_llama()
    with torch.no_grad():
        plain = fwdtrace.check_onnx(model, ids, exporter="dynamo", numeric=True)
    fwdtrace.register_atomic(ROPE)
    fwdtrace.register_atomic(LLAMA_ATTN)
    with torch.no_grad():
        report = fwdtrace.check_onnx(model, ids, exporter="dynamo", numeric=True)
        graph = fwdtrace.trace(model, ids)
    originals_back()
    # the reference: the same model unregistered, whose every call the export matches
    assert plain.status == "ok"
    assert report.status == "ok", report.text
    assert set(report.opened) == {ROPE, LLAMA_ATTN}
    assert report.numeric is not None and report.numeric.status == "ok" and report.first_divergence is None
    assert REGISTRY.functions[ROPE].atomic and len(graph.find(target=ROPE)) == LAYERS  # the registration stays
    # a graph alone cannot open them: incomplete, naming them, not a mismatch
    alone = fwdtrace.compare_onnx(graph, report.numeric.proto)
    assert alone.status == "incomplete", alone.text
    assert {n.split(" = ")[1].split(" in ")[0] for n in alone.not_opened} == {ROPE, LLAMA_ATTN}
