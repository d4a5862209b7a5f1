"""The shipped example workflows against ComfyUI's official templates they are built on.

Each workflow in ``CASES`` is an official template of ``comfyui-workflow-templates-json==0.1.123`` (read from the
installed package) flattened, with UNETLoader replaced by this pack's loader plus the A/B toggle:

* ``example_workflows/h3_t2v_1344x768_124f_fused_nvfp4.json``: ``video_minimax_h3_t2v.json`` (MiniMax H3 text to
  video), the turbo-LoRA switch left out;
* ``example_workflows/z_image_turbo_t2i_1024x1024_8steps_fused_nvfp4.json``: ``image_z_image_turbo.json`` (Z-Image
  Turbo text to image).

Every test below runs for each of them. They pin:

* every node type is a template node type or one of this pack's node ids;
* for template node types, the widget layout (count, names, order, value types) is the template's, and every value
  equals what the template actually runs with (its subgraph inputs, primitives, switches and math expression
  resolved), except the deliberate changes each case lists (``Case.deliberate``);
* the wiring is the template's (same edges once the switch is collapsed and UNETLoader is swapped for our nodes);
* the UI-format links are consistent;
* with the real headless ComfyUI the tests run (tests/comfy_harness.py): our nodes resolve through ComfyUI's
  loader, their widget values are valid for their schemas, and the API-format subgraph of our nodes passes
  ComfyUI's validation (V3 combo values included).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import json
import os
import pathlib
from dataclasses import dataclass, field

import comfy_harness as ch
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "example_workflows"

TEMPLATE_DIST = "comfyui-workflow-templates-json"
TEMPLATE_DIST_VERSION = "0.1.123"
TEMPLATE_PACKAGE = "comfyui_workflow_templates_json"  # import name inside that wheel

PACK_NODE_IDS = {"H3FusedNVFP4Loader", "H3FusedNVFP4Patch", "H3FusedNVFP4Toggle"}
# Template node types that only carry values or the turbo option; resolved away, not in our graphs.
PLUMBING_TYPES = {"PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "ComfySwitchNode", "ComfyMathExpression",
                  "ResolutionSelector"}
REPLACED_TYPES = {"UNETLoader": "H3FusedNVFP4Toggle"}  # whose MODEL output our toggle now provides
NOTE_TYPES = {"MarkdownNote", "Note"}
# Frontend-only widgets (not node inputs, absent from the API format)
FRONTEND_ONLY_WIDGETS = {"control_after_generate"}


@dataclass(frozen=True)
class Case:
    """One example workflow and the official template it is built on."""

    workflow: str  # file in example_workflows/
    template: str  # file in the templates package
    unet_name: str  # the Loader's file
    output_type: str  # the node every working node feeds
    # (node type, widget name) -> why our value differs from the value the template runs with. Nothing else may.
    deliberate: dict
    dropped_types: frozenset = frozenset()  # template working nodes left out (off in the template's default run)
    # Widget names of template nodes saved without ``widgets_values_named`` (older frontends); checked against the
    # real ComfyUI's schemas for its core node types (test_template_widget_names_are_comfyui_s).
    widget_names: dict = field(default_factory=dict)
    core_types: frozenset = frozenset()  # its node types from ComfyUI's core nodes.py (the rest are comfy_extras)

    def __str__(self):
        return self.workflow


H3_T2V = Case(
    workflow="h3_t2v_1344x768_124f_fused_nvfp4.json",
    template="templates/video_minimax_h3_t2v.json",
    unet_name="minimax_h3_fl2va_nvfp4.safetensors",
    output_type="SaveVideo",
    deliberate={
        ("MiniMaxH3ImageToVideo", "prompt"): "our own example prompt",
        ("MiniMaxH3ImageToVideo", "width"): "1344x768, H3's native 768p canvas (the template's Resolution Selector "
                                            "feeds 16:9 at 0.4 MP, i.e. 864x480)",
        ("MiniMaxH3ImageToVideo", "height"): "as width",
        ("SaveVideo", "filename_prefix"): "outputs of this workflow get their own prefix",
        ("MarkdownNote", "text"): "our notes: model files and how to A/B with the toggle",
    },
    dropped_types=frozenset({"LoraLoaderModelOnly"}),  # turbo LoRA: off in the template (turbo_mode False)
    core_types=frozenset({"CLIPLoader", "VAELoader", "VAEDecode"}),
)

Z_IMAGE_TURBO_T2I = Case(
    workflow="z_image_turbo_t2i_1024x1024_8steps_fused_nvfp4.json",
    template="templates/image_z_image_turbo.json",
    # Comfy-Org's Z-Image Turbo NVFP4 file (the templates package names none); the Loader's model link downloads it
    unet_name="z_image_turbo_nvfp4.safetensors",
    output_type="SaveImage",
    deliberate={
        ("KSampler", "control_after_generate"): "fixed instead of randomize: the A/B runs must reuse the seed",
        ("SaveImage", "filename_prefix"): "outputs of this workflow get their own prefix",
        ("MarkdownNote", "text"): "our notes: model files and how to A/B with the toggle",
    },
    widget_names={
        "CLIPLoader": ["clip_name", "type", "device"],
        "VAELoader": ["vae_name"],
        "UNETLoader": ["unet_name", "weight_dtype"],
        "CLIPTextEncode": ["text"],
        "ConditioningZeroOut": [],
        "EmptySD3LatentImage": ["width", "height", "batch_size"],
        "ModelSamplingAuraFlow": ["shift"],
        "KSampler": ["seed", "control_after_generate", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
        "VAEDecode": [],
        "SaveImage": ["filename_prefix"],
        "MarkdownNote": ["text"],
    },
    core_types=frozenset({"CLIPLoader", "VAELoader", "CLIPTextEncode", "ConditioningZeroOut", "KSampler",
                          "VAEDecode", "SaveImage"}),
)

CASES = [H3_T2V, Z_IMAGE_TURBO_T2I]

SUBGRAPH_INPUT_NODE, SUBGRAPH_OUTPUT_NODE = -10, -20


class LinkedAtTopLevel:
    """A subgraph input the template feeds from another top-level node (value computed at run time)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<linked at top level: {self.name}>"


# ---------------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------------


def load_workflow(case: Case) -> dict:
    return json.loads((EXAMPLES / case.workflow).read_text(encoding="utf-8"))


def load_template(case: Case) -> dict:
    try:
        files = importlib.resources.files(TEMPLATE_PACKAGE)
    except ModuleNotFoundError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{TEMPLATE_DIST}=={TEMPLATE_DIST_VERSION} not installed (tests/requirements-test.txt)")
    template = json.loads((files / case.template).read_text(encoding="utf-8"))
    graphs = [template, *template.get("definitions", {}).get("subgraphs", [])]
    for node in (n for graph in graphs for n in graph["nodes"]):
        if "widgets_values_named" not in node and node["type"] in case.widget_names:  # name the saved values
            names = case.widget_names[node["type"]]
            assert len(names) == len(node.get("widgets_values", [])), (node["type"], node.get("widgets_values"))
            node["widgets_values_named"] = dict(zip(names, node.get("widgets_values", [])))
    return template


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request) -> Case:
    return request.param


@pytest.fixture(scope="module")
def workflow(case) -> dict:
    return load_workflow(case)


@pytest.fixture(scope="module")
def template(case) -> dict:
    return load_template(case)


@pytest.fixture(scope="module")
def resolved(template, case) -> "ResolvedTemplate":
    return ResolvedTemplate(template, case)


def test_every_example_workflow_is_checked_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == sorted(c.workflow for c in CASES)


def nodes_by_id(graph: dict) -> dict[int, dict]:
    return {n["id"]: n for n in graph["nodes"]}


def widget_names(node: dict) -> list[str]:
    return list(node.get("widgets_values_named", {}))


# ---------------------------------------------------------------------------------------------------------------------
# the template, resolved: what each inner node actually runs with
# ---------------------------------------------------------------------------------------------------------------------


_MATH_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Load, ast.Constant, ast.Add, ast.Sub,
               ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.USub)


def eval_math(expression: str, **values):
    """Evaluate a ComfyMathExpression of the template: arithmetic, max/min/round and the named values only."""
    tree = ast.parse(expression, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _MATH_NODES):
            raise ValueError(f"unexpected syntax {type(node).__name__} in {expression!r}")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name)
                                               and node.func.id in ("max", "min", "round")):
            raise ValueError(f"unexpected call in {expression!r}")
    return eval(compile(tree, "<template expression>", "eval"), {"__builtins__": {}},
                {"max": max, "min": min, "round": round, **values})


class ResolvedTemplate:
    """The template's single subgraph with every linked widget replaced by the value that reaches it."""

    def __init__(self, template: dict, case: Case):
        self.template = template
        self.skipped = PLUMBING_TYPES | case.dropped_types
        (self.subgraph,) = template["definitions"]["subgraphs"]
        instances = [n for n in template["nodes"] if n["type"] == self.subgraph["id"]]
        assert len(instances) == 1
        self.instance = instances[0]
        self.nodes = nodes_by_id(self.subgraph)
        self.links = {link["id"]: link for link in self.subgraph["links"]}
        self.top_nodes = [n for n in template["nodes"] if n["type"] != self.subgraph["id"]]

    # values ----------------------------------------------------------------------------------------------------------

    def subgraph_input(self, slot: int):
        """The value the instance gives subgraph input ``slot``; None where the instance saves none (a promoted
        widget, ``proxyWidgets``: the inner node's own value is the one that runs)."""
        name = self.subgraph["inputs"][slot]["name"]
        for inp in self.instance["inputs"]:
            if inp.get("widget", {}).get("name") == name and inp.get("link") is not None:
                return LinkedAtTopLevel(name)
        return self.instance.get("widgets_values_named", {}).get(name)

    def input_value(self, node: dict, name: str):
        """Value arriving at input/widget ``name`` of inner ``node``."""
        for inp in node.get("inputs", []):
            if inp["name"] == name and inp.get("link") is not None:
                link = self.links[inp["link"]]
                if link["origin_id"] == SUBGRAPH_INPUT_NODE:
                    value = self.subgraph_input(link["origin_slot"])
                    return node["widgets_values_named"][name] if value is None else value
                return self.output_value(self.nodes[link["origin_id"]], link["origin_slot"])
        return node["widgets_values_named"][name]

    def output_value(self, node: dict, slot: int):
        kind = node["type"]
        if kind in ("PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean"):
            return self.input_value(node, "value")
        if kind == "ComfySwitchNode":
            return self.input_value(node, "on_true" if self.input_value(node, "switch") else "on_false")
        if kind == "ComfyMathExpression":
            values = {}
            for inp in node["inputs"]:
                if inp["name"].startswith("values.") and inp.get("link") is not None:
                    values[inp["name"].split(".", 1)[1]] = self.input_value(node, inp["name"])
            result = eval_math(node["widgets_values_named"]["expression"], **values)
            return {"INT": int, "FLOAT": float, "BOOL": bool}[node["outputs"][slot]["name"]](result)
        raise AssertionError(f"template node {node['id']} ({kind}) feeds a widget; teach ResolvedTemplate about it")

    def widgets(self, node: dict) -> dict:
        return {name: self.input_value(node, name) for name in widget_names(node)}

    # wiring ----------------------------------------------------------------------------------------------------------

    def source(self, node_id: int, slot: int) -> tuple[dict, int]:
        """Follow MODEL-style pass-through nodes (switches) back to the node that produces the value."""
        node = self.nodes[node_id]
        if node["type"] == "ComfySwitchNode":
            name = "on_true" if self.input_value(node, "switch") else "on_false"
            (inp,) = [i for i in node["inputs"] if i["name"] == name]
            link = self.links[inp["link"]]
            return self.source(link["origin_id"], link["origin_slot"])
        return node, slot

    def runs(self) -> list[dict]:
        """Inner and top-level nodes that do work in the template's default run (no plumbing, no turbo LoRA)."""
        inner = [n for n in self.subgraph["nodes"] if n["type"] not in self.skipped]
        top = [n for n in self.top_nodes if n["type"] not in PLUMBING_TYPES]
        return inner + top

    def edges(self, key) -> set[tuple]:
        """Data edges between working nodes as (origin key, output name, target key, input name)."""
        edges = set()
        for link in self.subgraph["links"]:
            if link["origin_id"] == SUBGRAPH_INPUT_NODE:
                continue  # widget values, compared separately
            origin, slot = self.source(link["origin_id"], link["origin_slot"])
            if origin["type"] in self.skipped:
                continue
            out_name = origin["outputs"][slot]["name"]
            if link["target_id"] == SUBGRAPH_OUTPUT_NODE:
                top = nodes_by_id(self.template)
                for top_link in self.template["links"]:
                    _, o_id, o_slot, t_id, t_slot, _ = top_link
                    if o_id == self.instance["id"] and o_slot == link["target_slot"]:
                        target = top[t_id]
                        edges.add((key(origin), out_name, key(target), target["inputs"][t_slot]["name"]))
                continue
            target = self.nodes[link["target_id"]]
            if target["type"] in self.skipped:
                continue
            edges.add((key(origin), out_name, key(target), target["inputs"][link["target_slot"]]["name"]))
        return edges


def node_key(values_of):
    """Key nodes by type; VAELoader (twice in the graph) also by the file it loads."""

    def key(node):
        if node["type"] == "VAELoader":
            return f"VAELoader[{values_of(node)['vae_name']}]"
        return REPLACED_TYPES.get(node["type"], node["type"])

    return key


def workflow_edges(workflow: dict) -> set[tuple]:
    nodes = nodes_by_id(workflow)
    key = node_key(lambda n: n["widgets_values_named"])
    edges = set()
    for lid, o_id, o_slot, t_id, t_slot, _ in workflow["links"]:
        origin, target = nodes[o_id], nodes[t_id]
        edges.add((key(origin), origin["outputs"][o_slot]["name"], key(target), target["inputs"][t_slot]["name"]))
    return edges


# ---------------------------------------------------------------------------------------------------------------------
# template-only tests (no ComfyUI needed)
# ---------------------------------------------------------------------------------------------------------------------


def test_template_is_the_pinned_official_one(case, template, resolved):
    assert importlib.metadata.version(TEMPLATE_DIST) == TEMPLATE_DIST_VERSION
    types = {n["type"] for n in resolved.subgraph["nodes"]}
    values = {n["type"]: resolved.widgets(n) for n in resolved.runs() if n["type"] not in ("VAELoader", *NOTE_TYPES)}
    if case is H3_T2V:
        assert {"UNETLoader", "MiniMaxH3ImageToVideo", "SamplerCustomAdvanced", "CreateVideo"} <= types
        # what the template runs with by default: 5 s -> 124 frames, 20 steps (turbo off), res_multistep
        assert values["MiniMaxH3ImageToVideo"]["length"] == 124
        assert values["BasicScheduler"] == {"scheduler": "simple", "steps": 20, "denoise": 1}
        assert values["KSamplerSelect"] == {"sampler_name": "res_multistep"}
        assert values["CreateVideo"]["fps"] == 24
    elif case is Z_IMAGE_TURBO_T2I:
        assert {"UNETLoader", "CLIPTextEncode", "ModelSamplingAuraFlow", "KSampler", "EmptySD3LatentImage"} <= types
        # what the template runs with: its prompt widget, 1024x1024, 8 steps res_multistep / simple, cfg 1, shift 3
        assert values["UNETLoader"] == {"unet_name": "z_image_turbo_bf16.safetensors", "weight_dtype": "default"}
        assert values["EmptySD3LatentImage"] == {"width": 1024, "height": 1024, "batch_size": 1}
        assert values["KSampler"] == {"seed": 0, "control_after_generate": "randomize", "steps": 8, "cfg": 1,
                                      "sampler_name": "res_multistep", "scheduler": "simple", "denoise": 1}
        assert values["ModelSamplingAuraFlow"] == {"shift": 3}
        assert values["CLIPLoader"]["type"] == "lumina2"
    else:  # pragma: no cover
        raise AssertionError(f"say what {case.template} runs with")


def test_node_types_are_template_types_or_ours(workflow, template, resolved):
    template_types = {n["type"] for n in resolved.subgraph["nodes"]} | {n["type"] for n in resolved.top_nodes}
    unknown = sorted({n["type"] for n in workflow["nodes"]} - template_types - PACK_NODE_IDS)
    assert not unknown, f"node types in neither the template nor this pack: {unknown}"
    assert "UNETLoader" not in {n["type"] for n in workflow["nodes"]}


def test_same_working_nodes_as_the_template(workflow, resolved):
    """The template's working nodes, each once (VAELoader twice), UNETLoader swapped for loader + toggle."""
    skip = PACK_NODE_IDS | NOTE_TYPES | set(REPLACED_TYPES)
    ours = sorted(n["type"] for n in workflow["nodes"] if n["type"] not in skip)
    theirs = sorted(n["type"] for n in resolved.runs() if n["type"] not in skip)
    assert ours == theirs
    assert sorted(n["type"] for n in workflow["nodes"] if n["type"] in PACK_NODE_IDS) == [
        "H3FusedNVFP4Loader", "H3FusedNVFP4Toggle"]


def test_widgets_match_template(case, workflow, resolved):
    by_type: dict[str, list[dict]] = {}
    for node in resolved.subgraph["nodes"] + resolved.top_nodes:
        by_type.setdefault(node["type"], []).append(node)
    problems = []
    for node in workflow["nodes"]:
        if node["type"] in PACK_NODE_IDS:
            continue
        refs = by_type[node["type"]]
        ref = refs[0]
        names = widget_names(ref)
        where = f"node {node['id']} {node['type']}"
        values = node.get("widgets_values", [])
        if len(values) != len(ref.get("widgets_values", [])):
            problems.append(f"{where}: {len(values)} widget values, template has {len(ref['widgets_values'])}")
            continue
        if widget_names(node) != names:
            problems.append(f"{where}: widget names {widget_names(node)} != template {names}")
            continue
        if list(node.get("widgets_values_named", {}).values()) != values:
            problems.append(f"{where}: widgets_values_named disagrees with widgets_values")
        run_values = [resolved.widgets(r) for r in refs]
        for i, (name, value) in enumerate(zip(names, values)):
            ref_types = {type(r["widgets_values"][i]) for r in refs}
            if type(value) not in ref_types:
                problems.append(f"{where}.{name}: {type(value).__name__}, "
                                f"template {sorted(t.__name__ for t in ref_types)}")
            if (node["type"], name) in case.deliberate:
                continue
            expected = [rv[name] for rv in run_values]
            if value not in expected:
                problems.append(f"{where}.{name}: {value!r} is not the template's {expected!r} (not a listed change)")
    assert not problems, "\n".join(problems)


def test_deliberate_changes_are_real_and_listed_values_only(case, workflow, resolved):
    """Every deliberate entry names a widget that exists; a stale entry would hide a real difference."""
    types = {n["type"]: widget_names(n) for n in workflow["nodes"]}
    for node_type, name in case.deliberate:
        assert name in types.get(node_type, []), (node_type, name)
    # and the template feeds every top-level-linked value only into widgets we deliberately set
    for node in resolved.runs():
        if node in resolved.top_nodes:
            continue
        for name, value in resolved.widgets(node).items():
            if isinstance(value, LinkedAtTopLevel):
                assert (node["type"], name) in case.deliberate, (node["type"], name, value)


def test_generation_settings(case, workflow):
    nodes = {}
    for node in workflow["nodes"]:
        nodes.setdefault(node["type"], []).append(node["widgets_values_named"]
                                                  if "widgets_values_named" in node else {})
    (loader,) = nodes["H3FusedNVFP4Loader"]
    assert loader["unet_name"] == case.unet_name
    (toggle,) = nodes["H3FusedNVFP4Toggle"]
    assert toggle["path"] == "fused"
    if case is H3_T2V:
        check_h3_t2v_settings(nodes)
    elif case is Z_IMAGE_TURBO_T2I:
        check_z_image_turbo_settings(nodes)
    else:  # pragma: no cover
        raise AssertionError(f"say what {case.workflow} generates")


def check_h3_t2v_settings(nodes):
    (i2v,) = nodes["MiniMaxH3ImageToVideo"]
    assert (i2v["width"], i2v["height"], i2v["length"]) == (1344, 768, 124)
    assert (i2v["length"] - 5) % 17 == 0  # H3's temporal grid: 17k + 5 frames
    assert i2v["width"] % 32 == 0 and i2v["height"] % 32 == 0
    assert i2v["prompt"].strip()
    assert nodes["KSamplerSelect"] == [{"sampler_name": "res_multistep"}]
    assert nodes["BasicScheduler"] == [{"scheduler": "simple", "steps": 20, "denoise": 1}]
    assert nodes["CreateVideo"][0]["fps"] == 24
    assert nodes["RandomNoise"][0]["control_after_generate"] == "fixed"  # A/B runs must reuse the seed
    assert nodes["CLIPLoader"][0]["type"] == "minimax"


def check_z_image_turbo_settings(nodes):
    (latent,) = nodes["EmptySD3LatentImage"]
    assert latent == {"width": 1024, "height": 1024, "batch_size": 1}
    (sampler,) = nodes["KSampler"]
    assert sampler["control_after_generate"] == "fixed"  # A/B runs must reuse the seed
    assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"], sampler["scheduler"]) == (
        8, 1, "res_multistep", "simple")
    assert nodes["ModelSamplingAuraFlow"] == [{"shift": 3}]
    assert nodes["CLIPLoader"][0]["type"] == "lumina2"
    assert nodes["CLIPTextEncode"][0]["text"].strip()


def test_wiring_matches_template(workflow, resolved):
    theirs = resolved.edges(node_key(resolved.widgets))
    ours = workflow_edges(workflow)
    added = {("H3FusedNVFP4Loader", "MODEL", "H3FusedNVFP4Toggle", "model")}
    assert ours - theirs == added, f"edges not in the template: {sorted(ours - theirs - added)}"
    assert theirs - ours == set(), f"template edges missing here: {sorted(theirs - ours)}"


def test_links_are_consistent(case, workflow):
    nodes = nodes_by_id(workflow)
    assert len(nodes) == len(workflow["nodes"]), "duplicate node ids"
    links = {}
    for link in workflow["links"]:
        assert len(link) == 6, link
        assert link[0] not in links, f"duplicate link id {link[0]}"
        links[link[0]] = link
    assert workflow["last_node_id"] >= max(nodes)
    assert workflow["last_link_id"] >= max(links)

    for lid, o_id, o_slot, t_id, t_slot, kind in links.values():
        assert o_id in nodes and t_id in nodes, f"link {lid} references a missing node"
        out = nodes[o_id]["outputs"][o_slot]
        inp = nodes[t_id]["inputs"][t_slot]
        assert out["type"] == kind == inp["type"], f"link {lid}: {out['type']} -> {kind} -> {inp['type']}"
        assert lid in (out["links"] or []), f"link {lid} not listed on node {o_id} output {o_slot}"
        assert inp["link"] == lid, f"link {lid} not set on node {t_id} input {t_slot}"

    for node in workflow["nodes"]:
        for slot, inp in enumerate(node.get("inputs", [])):
            if inp.get("link") is not None:
                link = links.get(inp["link"])
                assert link is not None and (link[3], link[4]) == (node["id"], slot), (node["id"], inp)
            else:
                optional = inp.get("shape") == 7  # the frontend's mark for optional sockets
                assert optional or "widget" in inp, (f"node {node['id']} {node['type']}: "
                                                     f"required input {inp['name']} unlinked")
        for slot, out in enumerate(node.get("outputs", [])):
            for lid in out.get("links") or []:
                assert lid in links and (links[lid][1], links[lid][2]) == (node["id"], slot), (node["id"], out)

    # every node does something: all non-note nodes reach the output node
    consumers = {}
    for _, o_id, _, t_id, _, _ in links.values():
        consumers.setdefault(o_id, set()).add(t_id)
    (save,) = [n["id"] for n in workflow["nodes"] if n["type"] == case.output_type]
    for node in workflow["nodes"]:
        if node["type"] in NOTE_TYPES or node["id"] == save:
            continue
        seen, todo = set(), [node["id"]]
        while todo:
            for nxt in consumers.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert save in seen, f"node {node['id']} {node['type']} does not feed the {case.output_type}"

    orders = sorted(n["order"] for n in workflow["nodes"])
    assert orders == list(range(len(workflow["nodes"])))
    for lid, o_id, _, t_id, _, _ in links.values():
        assert nodes[o_id]["order"] < nodes[t_id]["order"], f"link {lid} goes against execution order"


def test_notes_explain_files_and_ab(workflow):
    text = "\n".join(n["widgets_values"][0] for n in workflow["nodes"] if n["type"] in NOTE_TYPES)
    for folder in ("diffusion_models", "text_encoders", "vae"):
        assert f"{folder}/" in text
    values = [v for n in workflow["nodes"] for v in n.get("widgets_values", []) if str(v).endswith(".safetensors")]
    for filename in values:
        assert filename in text, f"{filename} is not in the notes"
    assert "path = comfy" in text and "path = fused" in text


# Linked model files that have no download: the link is the README section that says how to make one.
NO_DOWNLOAD = {"minimax_h3_fl2va_nvfp4.safetensors":
               "https://github.com/h3-fused-nvfp4/h3-fused-nvfp4#calibrating-and-converting"}


def test_model_links_download_the_file(workflow):
    """The frontend's missing-models list offers each node's ``properties.models[].url`` as the download of that
    file: a Hugging Face link is a ``/resolve/`` link ending in the file's name, never a folder page (``/tree/``)."""
    links = [m for n in workflow["nodes"] for m in n.get("properties", {}).get("models", [])]
    assert links
    for model in links:
        name, url = model["name"], model["url"]
        if name in NO_DOWNLOAD:
            assert url == NO_DOWNLOAD[name], model
            continue
        assert url.startswith("https://huggingface.co/") and "/resolve/" in url and "/tree/" not in url, model
        assert url.rsplit("/", 1)[1] == name, model


# ---------------------------------------------------------------------------------------------------------------------
# the real headless ComfyUI
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def nvfp4_file(case, comfyui, tmp_path):
    """Make the case's Loader file an existing models/diffusion_models file for ComfyUI's combo validation."""
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    (folder / case.unet_name).write_bytes(b"")
    with ch.diffusion_models_folder(folder):
        yield case.unet_name


def to_api(workflow: dict, node_ids: set[int] | None = None) -> dict:
    """UI format -> API format (``{id: {class_type, inputs}}``) for the chosen nodes, as the frontend submits it."""
    nodes = nodes_by_id(workflow)
    links = {link[0]: link for link in workflow["links"]}
    chosen = node_ids if node_ids is not None else {n["id"] for n in workflow["nodes"]
                                                      if n["type"] not in NOTE_TYPES}
    prompt = {}
    for nid in sorted(chosen):
        node = nodes[nid]
        inputs = {k: v for k, v in node.get("widgets_values_named", {}).items() if k not in FRONTEND_ONLY_WIDGETS}
        for inp in node.get("inputs", []):
            if inp.get("link") is None:
                continue
            _, o_id, o_slot, _, _, _ = links[inp["link"]]
            if o_id not in chosen:
                raise ValueError(f"node {nid} input {inp['name']} comes from node {o_id}, outside the subset")
            inputs[inp["name"]] = [str(o_id), o_slot]
        prompt[str(nid)] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def test_full_graph_converts_to_api(workflow):
    prompt = to_api(workflow)
    assert {v["class_type"] for v in prompt.values()} >= PACK_NODE_IDS - {"H3FusedNVFP4Patch"}
    for nid, node in prompt.items():
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in prompt, (nid, value)


def test_our_nodes_resolve_through_comfyui_loader(pack, comfyui):
    assert not hasattr(pack.module, "NODE_CLASS_MAPPINGS")  # V3 only
    assert set(pack.node_ids) >= PACK_NODE_IDS
    for node_id in PACK_NODE_IDS:
        assert node_id in comfyui.nodes.NODE_CLASS_MAPPINGS


def test_our_widget_values_fit_our_schemas(workflow, pack, comfyui, nvfp4_file):
    io = comfyui.io
    for node in workflow["nodes"]:
        if node["type"] not in PACK_NODE_IDS:
            continue
        schema = comfyui.nodes.NODE_CLASS_MAPPINGS[node["type"]].define_schema()
        widgets = [i for i in schema.inputs if isinstance(i, io.WidgetInput)]
        assert widget_names(node) == [w.id for w in widgets], node["type"]
        assert len(node["widgets_values"]) == len(widgets)
        for widget, value in zip(widgets, node["widgets_values"]):
            if isinstance(widget, io.Combo.Input):
                assert value in widget.options, f"{node['type']}.{widget.id}: {value!r} not in {widget.options}"
            else:  # pragma: no cover - our nodes only have combos today
                raise AssertionError(f"add a check for {type(widget).__name__} ({node['type']}.{widget.id})")
        sockets = [i.id for i in schema.inputs if not isinstance(i, io.WidgetInput)]
        assert [i["name"] for i in node["inputs"]] == sockets
        assert [o["type"] for o in node["outputs"]] == [o.io_type for o in schema.outputs]


def test_api_subset_of_our_nodes_validates(workflow, pack, comfyui, nvfp4_file):
    ours = {n["id"] for n in workflow["nodes"] if n["type"] in PACK_NODE_IDS}
    prompt = to_api(workflow, ours)
    toggle = [nid for nid, n in prompt.items() if n["class_type"] == "H3FusedNVFP4Toggle"]
    ch.validate_prompt(prompt, toggle)  # validates the loader too (the toggle's model input)

    # Prove the validation is live: a missing input and a value outside a combo are both rejected.
    broken = json.loads(json.dumps(prompt))
    del broken[toggle[0]]["inputs"]["path"]
    with pytest.raises(AssertionError, match="validation"):
        ch.validate_prompt(broken, toggle)
    broken = json.loads(json.dumps(prompt))
    broken[toggle[0]]["inputs"]["path"] = "neither"
    with pytest.raises(AssertionError, match="value_not_in_list"):
        ch.validate_prompt(broken, toggle)


def test_core_nodes_take_our_inputs(case, workflow, comfyui):
    """The API inputs we would submit are inputs of ComfyUI's own classes for its core node types (ComfyUI's
    nodes.py; comfy_extras nodes are loaded only by a full start)."""
    mappings = comfyui.nodes.NODE_CLASS_MAPPINGS
    prompt = to_api(workflow)
    checked = set()
    for node in prompt.values():
        if node["class_type"] not in case.core_types:
            continue
        spec = mappings[node["class_type"]].INPUT_TYPES()
        known = set(spec.get("required", {})) | set(spec.get("optional", {}))
        assert set(node["inputs"]) <= known, (node["class_type"], set(node["inputs"]) - known)
        checked.add(node["class_type"])
    assert checked == case.core_types


def test_template_widget_names_are_comfyui_s(case, comfyui):
    """The names this file gives a template's unnamed widget values are the widget inputs of ComfyUI's core node
    classes, in order (control_after_generate is the frontend's, right after seed)."""
    mappings = comfyui.nodes.NODE_CLASS_MAPPINGS
    for node_type, names in case.widget_names.items():
        if node_type not in mappings or node_type in NOTE_TYPES:
            continue  # a comfy_extras node: not loaded by the headless harness
        spec = mappings[node_type].INPUT_TYPES()
        widgets = [name for section in ("required", "optional") for name, value in spec.get(section, {}).items()
                   if isinstance(value[0], list) or value[0] in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")]
        assert [n for n in names if n not in FRONTEND_ONLY_WIDGETS] == widgets, (node_type, widgets)
