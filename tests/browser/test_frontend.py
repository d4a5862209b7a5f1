"""The pack in ComfyUI's real frontend: a real ComfyUI server (CPU) with this repository as a custom node, driven by
headless Chromium through Playwright.

* every example workflow (example_workflows/*.json) opens with no missing node type and no missing-node dialog,
  renders readably at its saved view (zoom above the low-quality threshold, the Loader's title text drawn on the
  canvas, the Loader on screen), and the missing-models list names the folder of each model it links;
* every example workflow opened from the Templates dialog (its card clicked) keeps its saved view, as opened from
  the file (the frontend fits every template whole into the view, which left them at about a third of their size);
* a tiny random-weight H3 graph (Loader -> Toggle -> Preview Any, the nodes at the size a new node gets) runs
  through the server's queue; the Loader and the Toggle then show their whole decision text (web/h3_fused_nvfp4.js:
  nothing clipped in the box, the box inside the node), which never enters widgets_values or the prompt;
* the text survives save and reopen (serialized workflow -> loadGraphData), and the pack's progress text shows too;
* the same graph queued again from a fresh tab is served from ComfyUI's execution cache: the whole text shows there
  too (ComfyUI re-sends a cached node's UI output: the nodes declare has_intermediate_output), with a line saying the
  result was reused, and the browser's console logs it.

Every test runs on two frontends: the one tests/requirements-test.txt pins (or ``H3_FRONTEND_ROOT``) and
comfyui-frontend-package 1.58.1, which the test installs with pip into build/frontends/ (once; ``--front-end-root``).

Only 127.0.0.1 is contacted: every other request is blocked and recorded, and the test asserts there was none.
Screenshots of each step: tests/browser/artifacts/ (git-ignored). Outside CI the test skips when Playwright, a
Chromium, ComfyUI's frontend package or its server dependencies are missing; with CI=1 it fails instead.

Environment: H3_CHROMIUM (browser binary; default Debian's /usr/lib/chromium/chromium, /usr/bin/chromium),
H3_FRONTEND_ROOT (a comfyui_frontend_package ``static`` folder to test instead of the installed package),
H3_UPDATE_THUMBNAILS=1 (write example_workflows/<name>.jpg from the screenshot of the saved view, pinned frontend).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "example_workflows"
ARTIFACTS = pathlib.Path(__file__).resolve().parent / "artifacts"
FRONTENDS_DIR = REPO_ROOT / "build" / "frontends"
PINNED = "pinned"
LATER_FRONTEND = "1.58.1"  # a later frontend than the pinned one: the layout and template code changed in between
PACK_FOLDER = "h3-fused-nvfp4"  # the folder name a registry install uses
EXTENSION_NAME = "H3FusedNVFP4.DecisionText"
PACK_NODE_IDS = ("H3FusedNVFP4Loader", "H3FusedNVFP4Patch", "H3FusedNVFP4Toggle", "H3FusedNVFP4Calibrate",
                 "H3FusedNVFP4SaveCalibrated")
TINY_UNET = "tiny_h3_nvfp4.safetensors"
DECISION_PREFIX = "H3 fused NVFP4:"
READABLE_SCALE = 0.6  # below this the frontend draws nodes without text (low-quality rendering)
VIEWPORT = {"width": 1600, "height": 900}
THUMBNAIL_BOX = (60, 40, 1290, 900)  # left, top, right, bottom of the screenshot: the canvas between the bars
SERVER_START_S = 180
PAGE_S = 90
RUN_S = 240
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")
SERVER_MODULES = ("aiohttp", "yarl", "alembic", "sqlalchemy", "requests", "simpleeval", "blake3")
IN_CI = bool(os.environ.get("CI"))

pytestmark = pytest.mark.slow


def unavailable(reason: str):
    """Skip outside CI; in CI a missing prerequisite is a failure."""
    if IN_CI:
        pytest.fail(f"browser test prerequisite missing in CI: {reason}")
    pytest.skip(reason)


def chromium_path() -> str | None:
    candidates = [os.environ.get("H3_CHROMIUM")] + list(CHROMIUM_CANDIDATES) + [shutil.which("chromium")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def later_frontend_root(version: str) -> tuple[pathlib.Path, str]:
    """comfyui-frontend-package ``version`` installed with pip into build/frontends/<version> (once)."""
    target = FRONTENDS_DIR / version
    static = target / "comfyui_frontend_package" / "static"
    if not (static / "index.html").is_file():
        shutil.rmtree(target, ignore_errors=True)
        run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet",
                              "--disable-pip-version-check", "--target", str(target),
                              f"comfyui-frontend-package=={version}"], capture_output=True, text=True, timeout=600)
        if run.returncode != 0 or not (static / "index.html").is_file():
            shutil.rmtree(target, ignore_errors=True)
            unavailable(f"comfyui-frontend-package=={version} could not be installed: {run.stderr[-500:]}")
    return static, version


def frontend_root(which: str = PINNED) -> tuple[pathlib.Path, str]:
    """The frontend's static folder and its version (the installed comfyui-frontend-package or H3_FRONTEND_ROOT;
    or a later one)."""
    if which != PINNED:
        return later_frontend_root(which)
    override = os.environ.get("H3_FRONTEND_ROOT")
    if override:
        root = pathlib.Path(override)
        if not (root / "index.html").is_file():
            unavailable(f"H3_FRONTEND_ROOT={override} has no index.html")
        return root, f"custom:{root.parent.parent.name}"
    try:
        import comfyui_frontend_package
    except ImportError:
        unavailable("comfyui-frontend-package not installed (tests/requirements-test.txt)")
    root = pathlib.Path(comfyui_frontend_package.__file__).parent / "static"
    return root, importlib.metadata.version("comfyui-frontend-package")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


# ---------------------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------------------


class Server:
    def __init__(self, process: subprocess.Popen, port: int, base: pathlib.Path, artifacts: pathlib.Path,
                 frontend: str):
        self.process, self.port, self.base, self.artifacts, self.frontend = process, port, base, artifacts, frontend
        self.log = artifacts / "server.log"
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

    def get_json(self, path: str):
        return json.loads(http_get(self.url + path))


def write_tiny_model(folder: pathlib.Path) -> None:
    from safetensors.torch import save_file

    from h3_fused_nvfp4.tools import synthetic as syn

    sd = syn.model_state_dict(num_layers=2, refiner_layers=2, seed=3, static_layers=("attn.out_proj",))
    save_file(sd, str(folder / TINY_UNET))


@pytest.fixture(scope="module", params=[PINNED, LATER_FRONTEND])
def prerequisites(request):
    import comfy_harness

    reason = comfy_harness.comfyui_reason()
    if reason is not None:
        unavailable(f"real ComfyUI: {reason}")
    comfyui = request.getfixturevalue("comfyui")
    try:
        importlib.import_module("playwright.sync_api")
    except ImportError:
        unavailable("playwright (pip) not installed (tests/requirements-test.txt)")
    browser = chromium_path()
    if browser is None:
        unavailable("no Chromium (apt-get install chromium; or set H3_CHROMIUM)")
    for module in SERVER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            unavailable(f"{module} (ComfyUI's server needs it) not installed (tests/requirements-test.txt)")
    root, version = frontend_root(request.param)
    return {"chromium": browser, "frontend_root": root, "frontend_version": version, "comfyui": comfyui,
            "custom_frontend": request.param != PINNED or bool(os.environ.get("H3_FRONTEND_ROOT"))}


@pytest.fixture(scope="module")
def server(prerequisites, tmp_path_factory):
    """ComfyUI's main.py on CPU, 127.0.0.1 and a free port, everything it writes under a temporary base folder."""
    comfy_root = prerequisites["comfyui"].root
    base = tmp_path_factory.mktemp("comfy-base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(REPO_ROOT, target_is_directory=True)
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    write_tiny_model(models)
    settings = base / "user" / "default"
    settings.mkdir(parents=True)
    # no first-run templates browser, version notifications or minimap over the canvas
    (settings / "comfy.settings.json").write_text(json.dumps({
        "Comfy.TutorialCompleted": True,
        "Comfy.Notification.ShowVersionUpdates": False,
        "Comfy.Workflow.ShowMissingModelsWarning": True,
        "Comfy.Workflow.ShowMissingNodesWarning": True,
        "Comfy.Minimap.Visible": False,
    }))
    artifacts = ARTIFACTS / ("frontend-" + prerequisites["frontend_version"].replace(":", "-"))
    artifacts.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", str(base), "--user-directory", str(base / "user"),
           "--output-directory", str(base / "output"), "--temp-directory", str(base / "temp"),
           "--input-directory", str(base / "input"), "--database-url", "sqlite:///:memory:",
           "--disable-auto-launch", "--disable-api-nodes"]  # no partner nodes; the frontend skips its update check
    if prerequisites["custom_frontend"]:
        cmd += ["--front-end-root", str(prerequisites["frontend_root"])]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", H3_FUSED_NVFP4_REFERENCE_ON_CPU="1", PYTHONUNBUFFERED="1")
    with open(artifacts / "server.log", "w", encoding="utf-8") as out:
        process = subprocess.Popen(cmd, cwd=comfy_root, env=env, stdout=out, stderr=subprocess.STDOUT)
    srv = Server(process, port, base, artifacts, prerequisites["frontend_version"])
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"ComfyUI exited with {process.returncode}:\n{srv.log_tail()}")
            try:
                info = srv.get_json("/object_info/H3FusedNVFP4Loader")
                break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ComfyUI did not answer within {SERVER_START_S} s:\n{srv.log_tail()}")
            time.sleep(0.5)
        assert TINY_UNET in info["H3FusedNVFP4Loader"]["input"]["required"]["unet_name"][1]["options"] or \
            TINY_UNET in json.dumps(info), info
        extensions = srv.get_json("/extensions")
        assert f"/extensions/{PACK_FOLDER}/h3_fused_nvfp4.js" in extensions, extensions
        yield srv
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# ---------------------------------------------------------------------------------------------------------------------
# the browser
# ---------------------------------------------------------------------------------------------------------------------


class Browser:
    def __init__(self, chromium, server: Server):
        self.chromium, self.server = chromium, server
        self.blocked: list[str] = []
        self.page_errors: list[str] = []
        self.console: list[str] = []  # the current page's console messages
        self.context = self.page = None

    def route(self, r):
        """127.0.0.1:<port> only; anything else is recorded and aborted."""
        parts = urllib.parse.urlsplit(r.request.url)
        if parts.scheme in ("http", "https", "ws", "wss") and parts.netloc == f"127.0.0.1:{self.server.port}":
            r.continue_()
        elif parts.scheme in ("data", "blob"):
            r.continue_()
        else:
            self.blocked.append(r.request.url)
            r.abort()

    def open_page(self):
        """A fresh context (no panel state from earlier steps) and page with the app started and this pack's
        extension registered; it becomes ``self.page``."""
        if self.context is not None:
            self.context.close()
        self.context = self.chromium.new_context(viewport=VIEWPORT, device_scale_factor=1, service_workers="block")
        self.context.set_default_timeout(PAGE_S * 1000)
        self.context.route("**/*", self.route)
        page = self.context.new_page()
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        self.console = []
        page.on("console", lambda message: self.console.append(message.text))
        page.goto(self.server.url + "/", wait_until="domcontentloaded", timeout=PAGE_S * 1000)
        page.wait_for_function(
            "(name) => window.app && window.app.graph && window.app.canvas && "
            "(window.app.extensions ?? []).some((e) => e.name === name)",
            arg=EXTENSION_NAME, timeout=PAGE_S * 1000)
        page.wait_for_timeout(1500)
        self.page = page
        self.close_dialogs()
        return page

    def shot(self, name: str, **kwargs) -> pathlib.Path:
        path = self.server.artifacts / f"{name}.png"
        self.page.screenshot(path=str(path), timeout=30_000, **kwargs)
        return path

    def js(self, expression: str, arg=None):
        return self.page.evaluate(expression, arg)

    def close_dialogs(self):
        for _ in range(3):
            if not self.js("() => document.querySelectorAll('.p-dialog-mask, .p-dialog').length"):
                return
            self.page.keyboard.press("Escape")
            self.page.wait_for_timeout(300)

    def load(self, graph: dict, name: str):
        self.js("""async ([graph, name]) => { await window.app.loadGraphData(graph, true, true, name); }""",
                [graph, name])
        self.page.wait_for_timeout(1000)  # dialogs, error panels and DOM widgets appear on the next frames

    def open_template(self, stem: str):
        """The Templates dialog (the frontend's Browse Templates command, as its sidebar button runs it), then a
        click on the card of this pack's example ``stem``."""
        self.js("async () => { await window.app.extensionManager.command.execute('Comfy.BrowseTemplates'); }")
        card = self.page.locator(f'[data-testid="template-workflow-{stem}"]').first
        card.wait_for(timeout=PAGE_S * 1000)
        card.click()
        self.page.wait_for_function(
            "(n) => (window.app.graph._nodes ?? window.app.graph.nodes).length === n && "
            "!document.querySelector('[data-testid=\"template-workflows-content\"]')",
            arg=len(json.loads((EXAMPLES / f"{stem}.json").read_text(encoding="utf-8"))["nodes"]),
            timeout=PAGE_S * 1000)
        self.page.wait_for_timeout(1500)  # the view is set on the next frames

    def queue(self) -> dict:
        """The current graph queued through the server's /prompt with this tab's client id (as Run does)."""
        return self.js("""async () => {
          const r = await fetch('/prompt', {method: 'POST', headers: {'Content-Type': 'application/json'},
            body: JSON.stringify({prompt: (await window.app.graphToPrompt()).output,
                                  client_id: window.comfyAPI?.api?.api?.clientId ?? window.app.api?.clientId}) });
          return await r.json();
        }""")


@pytest.fixture(scope="module")
def browser(server, prerequisites):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=prerequisites["chromium"], headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
                                     timeout=60_000)
        try:
            b = Browser(chromium, server)
            b.open_page()
            yield b
            assert b.blocked == [], f"requests to hosts other than 127.0.0.1:{server.port}: {b.blocked}"
        finally:
            chromium.close()


# ---------------------------------------------------------------------------------------------------------------------
# helpers run in the page
# ---------------------------------------------------------------------------------------------------------------------

NODE_STATE_JS = """(id) => {
  const node = window.app.graph.getNodeById(id);
  if (!node) return null;
  const w = (node.widgets ?? []).find((w) => w.name === 'h3_decision');
  const el = w?.element ?? w?.h3Element;
  const rect = el ? el.getBoundingClientRect() : null;
  const style = el ? getComputedStyle(el) : null;
  // the node's body on screen (below its title): the text box must lie inside it
  const c = window.app.canvas, s = c.ds.scale, o = c.ds.offset, area = c.canvas.getBoundingClientRect();
  const body = {right: area.left + (node.pos[0] + node.size[0] + o[0]) * s,
                bottom: area.top + (node.pos[1] + node.size[1] + o[1]) * s};
  return {
    type: node.type, properties: node.properties, size: node.size,
    widget: w ? {value: w.value, serialize: w.serialize, optionsSerialize: w.options?.serialize,
                 domValue: el?.value ?? null,
                 visible: !!rect && rect.width > 20 && rect.height > 20 && style.display !== 'none'
                          && style.visibility !== 'hidden',
                 // every line shown: nothing to scroll to in the box, and the box not cut off by the node's edge
                 text_px: [el.clientHeight, el.scrollHeight],
                 whole: el.scrollHeight <= el.clientHeight + 1 && el.scrollWidth <= el.clientWidth + 1
                        && rect.bottom <= body.bottom + 1 && rect.right <= body.right + 1} : null,
    widgetNames: (node.widgets ?? []).map((w) => w.name),
  };
}"""

DEFAULT_SIZES_JS = """() => {
  // every node at the size the frontend gives a node added from the node library
  for (const node of window.app.graph._nodes ?? window.app.graph.nodes) node.setSize(node.computeSize());
  window.app.canvas.setDirty(true, true);
}"""

VIEW_JS = """(loaderType) => {
  const c = window.app.canvas;
  const nodes = window.app.graph._nodes ?? window.app.graph.nodes;
  const loader = nodes.find((n) => n.type === loaderType);
  const [x, y] = c.ds.convertOffsetToCanvas ? c.ds.convertOffsetToCanvas(loader.pos) : [0, 0];
  const s = c.ds.scale, o = c.ds.offset;
  const rect = c.canvas.getBoundingClientRect();
  const titleH = (window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30);
  return {
    scale: s, offset: [o[0], o[1]], lowQuality: !!c.low_quality,
    loaderTitle: {x: rect.left + (loader.pos[0] + o[0]) * s, y: rect.top + (loader.pos[1] - titleH + o[1]) * s,
                  w: loader.size[0] * s, h: titleH * s},
    canvas: {w: rect.width, h: rect.height},
    types: nodes.map((n) => n.type),
    registered: nodes.map((n) => n.type).filter((t) => !(window.LiteGraph?.registered_node_types ?? {})[t]),
  };
}"""

DIALOGS_JS = """() => Array.from(document.querySelectorAll('.p-dialog')).map((d) => d.innerText)"""


def bright_pixels(png: pathlib.Path, box: dict) -> int:
    """Pixels in the box clearly brighter than the title bar: the title text the canvas drew."""
    from PIL import Image

    with Image.open(png) as im:
        gray = im.convert("L").crop((int(box["x"] + 8), int(box["y"] + 3), int(box["x"] + box["w"] - 8),
                                     int(box["y"] + box["h"] - 3)))
        values = list(gray.tobytes())
    if not values:
        return 0
    background = sorted(values)[len(values) // 2]
    return sum(1 for v in values if v > background + 60)


def tiny_graph() -> dict:
    """Loader -> Toggle -> Preview Any, UI format."""
    def node(id_, type_, pos, size, inputs, outputs, widgets):
        return {"id": id_, "type": type_, "pos": pos, "size": size, "flags": {}, "order": id_ - 1, "mode": 0,
                "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": type_},
                "widgets_values": widgets}

    return {
        "last_node_id": 3, "last_link_id": 2,
        "nodes": [
            node(1, "H3FusedNVFP4Loader", [40, 80], [440, 130], [],
                 [{"name": "MODEL", "type": "MODEL", "links": [1]}], [TINY_UNET, "default", "block"]),
            node(2, "H3FusedNVFP4Toggle", [540, 80], [440, 110], [{"name": "model", "type": "MODEL", "link": 1}],
                 [{"name": "MODEL", "type": "MODEL", "links": [2]}], ["fused", "as patched"]),
            node(3, "PreviewAny", [1040, 80], [400, 260], [{"name": "source", "type": "*", "link": 2}],
                 [{"name": "STRING", "type": "STRING", "links": []}], []),
        ],
        "links": [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 3, 0, "*"]],
        "groups": [], "config": {}, "extra": {"ds": {"scale": 1.0, "offset": [90, 110]}}, "version": 0.4,
    }


def wait_for_prompt(server: Server, prompt_id: str) -> dict:
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        history = server.get_json(f"/history/{prompt_id}")
        entry = history.get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None and (
                entry["status"].get("completed") or entry["status"].get("status_str") == "error"):
            return entry
        if server.process.poll() is not None:
            pytest.fail(f"ComfyUI exited:\n{server.log_tail()}")
        time.sleep(0.5)
    pytest.fail(f"prompt {prompt_id} did not finish within {RUN_S} s:\n{server.log_tail()}")


# ---------------------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------------------


def test_extension_is_served_and_registered(browser):
    assert browser.js("(n) => (window.app.extensions ?? []).filter((e) => e.name === n).length",
                      EXTENSION_NAME) == 1
    print(f"frontend {browser.server.frontend}")


MISSING_MODELS_JS = """() => {
  // the frontend's missing-models list (a dialog in older frontends, the error panel's details in newer ones)
  const more = Array.from(document.querySelectorAll('button')).find((b) => /view details/i.test(b.innerText));
  if (more) more.click();
  return null;
}"""


def missing_model_lines(browser) -> list[str]:
    browser.js(MISSING_MODELS_JS)
    browser.page.wait_for_timeout(1500)
    text = browser.js("() => document.body.innerText")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.lower() == "missing models"]
    return lines[starts[0]:starts[0] + 60] if starts else []


def test_templates_dialog_gets_workflows_and_thumbnails(server):
    """ComfyUI lists example_workflows/ for the Templates dialog; each card's image is <name>.jpg beside it."""
    listed = server.get_json("/workflow_templates")
    stems = sorted(p.stem for p in EXAMPLES.glob("*.json"))
    assert sorted(listed.get(PACK_FOLDER, [])) == stems, listed
    for stem in stems:
        base = f"{server.url}/api/workflow_templates/{PACK_FOLDER}/{urllib.parse.quote(stem)}"
        assert json.loads(http_get(base + ".json"))["nodes"], stem
        assert http_get(base + ".jpg")[:3] == b"\xff\xd8\xff", f"{stem}.jpg is not served as a JPEG"


@pytest.mark.parametrize("workflow", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_example_workflow_opens_readably(browser, workflow):
    graph = json.loads((EXAMPLES / workflow).read_text(encoding="utf-8"))
    stem = pathlib.Path(workflow).stem
    linked = {m["name"]: m["directory"] for n in graph["nodes"] for m in n.get("properties", {}).get("models", [])}
    loader_models = [m for n in graph["nodes"] if n["type"] == "H3FusedNVFP4Loader"
                     for m in n.get("properties", {}).get("models", [])]
    assert loader_models and all(m["directory"] == "diffusion_models" for m in loader_models), loader_models

    # 1. as a user without the models opens it: no missing node, every model listed with its folder
    browser.open_page()
    browser.load(graph, workflow)
    browser.shot(f"{stem}-opened")
    dialogs = browser.js(DIALOGS_JS)
    assert not [d for d in dialogs if "missing" in d.lower() and "node" in d.lower()], dialogs
    view = browser.js(VIEW_JS, "H3FusedNVFP4Loader")
    assert not view["registered"], f"node types the frontend does not know: {view['registered']}"
    lines = missing_model_lines(browser)
    browser.shot(f"{stem}-missing-models")
    assert lines, "no missing-models list although the models are not installed"
    for name, directory in linked.items():
        assert name in lines, (name, lines)
        assert lines[lines.index(name) + 1] == directory, (name, directory, lines)
    assert not [line for line in lines if line.lower() == "unknown"], lines

    # 2. with the models in place (empty stand-ins): the saved view as it renders, opened as a file and from the
    #    Templates dialog
    for name, directory in linked.items():
        folder = browser.server.base / "models" / directory
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).touch()
    try:
        browser.open_page()
        browser.load(graph, workflow)
        browser.close_dialogs()
        view = browser.js(VIEW_JS, "H3FusedNVFP4Loader")
        png = browser.shot(f"{stem}-saved-view")
        browser.open_page()
        browser.open_template(stem)
        browser.close_dialogs()
        template_view = browser.js(VIEW_JS, "H3FusedNVFP4Loader")
        template_png = browser.shot(f"{stem}-from-templates-dialog")
    finally:
        for name, directory in linked.items():
            (browser.server.base / "models" / directory / name).unlink()
    for how, v, shot in (("file", view, png), ("Templates dialog", template_view, template_png)):
        assert v["scale"] >= READABLE_SCALE and not v["lowQuality"], (how, v)
        assert abs(v["scale"] - graph["extra"]["ds"]["scale"]) < 1e-6, (how, v)  # the saved view was restored
        title = v["loaderTitle"]
        assert 0 <= title["x"] and title["x"] + title["w"] <= v["canvas"]["w"], (how, v)
        assert 0 <= title["y"] and title["y"] + title["h"] <= v["canvas"]["h"], (how, v)
        assert bright_pixels(shot, title) > 40, f"no title text drawn on the Loader ({how}: {shot})"
    if os.environ.get("H3_UPDATE_THUMBNAILS") == "1" and browser.server.frontend != LATER_FRONTEND:
        from PIL import Image

        with Image.open(png) as im:  # the graph area: without the side bars and the tab bar
            im.convert("RGB").crop(THUMBNAIL_BOX).resize((640, 448), Image.LANCZOS).save(
                EXAMPLES / f"{stem}.jpg", quality=85, optimize=True)
    browser.open_page()


def test_decision_text_after_a_run_and_after_reopen(browser):
    server = browser.server
    browser.load(tiny_graph(), "h3-tiny")
    browser.close_dialogs()
    browser.js(DEFAULT_SIZES_JS)
    browser.shot("tiny-before-run")
    before = browser.js(NODE_STATE_JS, 1)
    assert before["widget"] is None and "h3_decision" not in before["properties"], before

    # the prompt the frontend sends never carries the text box
    prompt = browser.js("async () => (await window.app.graphToPrompt()).output")
    assert set(prompt) == {"1", "2", "3"}, prompt
    assert prompt["1"]["inputs"] == {"unet_name": TINY_UNET, "weight_dtype": "default", "scope": "block"}, prompt

    queued = browser.queue()
    assert "prompt_id" in queued, queued
    entry = wait_for_prompt(server, queued["prompt_id"])
    assert entry["status"]["status_str"] == "success", (entry["status"], server.log_tail())
    server_text = {k: v.get("text", [""])[0] for k, v in entry["outputs"].items() if "text" in v}
    assert server_text["1"].startswith(DECISION_PREFIX), server_text
    browser.page.wait_for_function(
        """([prefix]) => [1, 2].every((id) => {
             const w = (window.app.graph.getNodeById(id)?.widgets ?? []).find((w) => w.name === 'h3_decision');
             return w && typeof w.value === 'string' && w.value.startsWith(prefix);
           })""", arg=[DECISION_PREFIX], timeout=RUN_S * 1000)
    browser.page.wait_for_timeout(500)
    browser.shot("tiny-after-run")
    for node_id in (1, 2):
        state = browser.js(NODE_STATE_JS, node_id)
        assert state["widget"]["value"] == server_text[str(node_id)], (state, server_text)
        assert state["widget"]["domValue"] == server_text[str(node_id)] and state["widget"]["visible"], state
        assert state["widget"]["whole"], f"node {node_id}'s text is cut off (shown, needed px): {state}"
        assert state["widget"]["serialize"] is False and state["widget"]["optionsSerialize"] is False, state
        assert state["properties"]["h3_decision"] == server_text[str(node_id)], state
    assert "patched" in server_text["1"] or "ComfyUI" in server_text["1"], server_text

    prompt = browser.js("async () => (await window.app.graphToPrompt()).output")
    assert prompt["1"]["inputs"] == {"unet_name": TINY_UNET, "weight_dtype": "default", "scope": "block"}, prompt
    assert "h3_decision" not in prompt["2"]["inputs"], prompt

    # the pack's progress text (the block self-check verdict arrives this way while a model samples)
    progress = f"{DECISION_PREFIX} block self-check passed: (shown by the test)"
    browser.js("""([text]) => window.comfyAPI.api.api.dispatchCustomEvent('progress_text', {nodeId: '1', text})""",
               [progress])
    state = browser.js(NODE_STATE_JS, 1)
    assert state["widget"]["value"] == server_text["1"] + "\n" + progress, state

    # save: widgets_values are the node's own, the text is in properties
    saved = browser.js("() => JSON.stringify(window.app.graph.serialize())")
    (browser.server.artifacts / "tiny-saved.json").write_text(saved, encoding="utf-8")
    saved = json.loads(saved)
    nodes = {n["id"]: n for n in saved["nodes"]}
    assert nodes[1]["widgets_values"] == [TINY_UNET, "default", "block"], nodes[1]
    assert nodes[2]["widgets_values"] == ["fused", "as patched"], nodes[2]
    assert nodes[1]["properties"]["h3_decision"] == server_text["1"], nodes[1]
    assert nodes[1]["properties"]["h3_progress"] == progress, nodes[1]
    assert nodes[2]["properties"]["h3_decision"] == server_text["2"], nodes[2]

    # reopen: another graph first, then the saved one
    examples = sorted(EXAMPLES.glob("*.json"))
    browser.load(json.loads(examples[0].read_text(encoding="utf-8")) if examples else tiny_graph(), "other")
    browser.close_dialogs()
    browser.load(saved, "h3-tiny-reopened")
    browser.close_dialogs()
    browser.page.wait_for_timeout(500)
    browser.shot("tiny-reopened")
    for node_id in (1, 2):
        state = browser.js(NODE_STATE_JS, node_id)
        want = server_text[str(node_id)] + ("\n" + progress if node_id == 1 else "")
        assert state["widget"] and state["widget"]["value"] == want and state["widget"]["domValue"] == want, state
        assert state["widget"]["visible"] and state["widget"]["whole"], state
    again = json.loads(browser.js("() => JSON.stringify(window.app.graph.serialize())"))
    assert {n["id"]: n["widgets_values"] for n in again["nodes"]} == {n["id"]: n["widgets_values"]
                                                                     for n in saved["nodes"]}
    assert not browser.page_errors, browser.page_errors


def test_a_cached_run_in_a_fresh_tab_shows_the_whole_text(browser):
    """The graph queued again from a fresh tab: ComfyUI serves every node from its execution cache and runs none; the
    Loader and the Toggle still show their whole text, say that the result was reused, and the console says so."""
    server = browser.server
    texts = {}
    for tab in ("first tab", "fresh tab"):
        browser.open_page()  # a new browser context: another client id, an empty graph
        browser.load(tiny_graph(), f"h3-tiny {tab}")
        browser.close_dialogs()
        browser.js(DEFAULT_SIZES_JS)
        queued = browser.queue()
        assert "prompt_id" in queued, queued
        entry = wait_for_prompt(server, queued["prompt_id"])  # the first tab's run may be served from cache too
        assert entry["status"]["status_str"] == "success", (entry["status"], server.log_tail())
        sent = {k: v["text"][0] for k, v in entry["outputs"].items() if "text" in v}
        assert {"1", "2"} <= set(sent), f"{tab}: no text for the pack nodes in the prompt's history: {sent}"
        if tab == "first tab":
            texts = sent
    cached = [m[1]["nodes"] for m in entry["status"]["messages"] if m[0] == "execution_cached"]
    assert cached and {"1", "2", "3"} <= set(cached[0]), entry["status"]["messages"]
    assert sent == texts, (sent, texts)
    browser.page.wait_for_function(
        """(texts) => Object.entries(texts).every(([id, text]) => {
             const w = (window.app.graph.getNodeById(id)?.widgets ?? []).find((w) => w.name === 'h3_decision');
             return w && typeof w.value === 'string' && w.value.startsWith(text);
           })""", arg={k: texts[k] for k in ("1", "2")}, timeout=30_000)
    browser.page.wait_for_timeout(500)
    browser.shot("tiny-cached-fresh-tab")
    for node_id in ("1", "2"):
        state = browser.js(NODE_STATE_JS, node_id)
        lines = state["widget"]["value"].split("\n")
        assert lines[0] == texts[node_id] and "from ComfyUI's cache" in lines[-1], state
        assert state["properties"]["h3_decision"] == texts[node_id] and state["properties"]["h3_cached"], state
        assert state["widget"]["visible"] and state["widget"]["whole"], state
        logged = [m for m in browser.console if f"node #{node_id} " in m and "served from ComfyUI's cache" in m]
        assert logged and texts[node_id] in logged[0], browser.console
    assert not browser.page_errors, browser.page_errors


def test_only_localhost_was_contacted(browser):
    assert browser.blocked == [], f"requests to hosts other than 127.0.0.1:{browser.server.port}: {browser.blocked}"
