// H3 Fused NVFP4: shows each pack node's decision text on the node.
//
// The nodes return their decision as UI text (ui.PreviewText): "patched N blocks ...", or why ComfyUI's own path
// runs. They are not output nodes, so nothing in ComfyUI's frontend draws it. This extension puts it in a
// read-only text box below the node's widgets, updates it when the node runs, and keeps it in the node's
// properties so that it is still there when the workflow is saved and reopened. The text box never enters the
// workflow's widgets_values nor the prompt sent to the server (serialize: false), so widget order and caching
// are unchanged. Progress text the pack sends while a model runs (the block self-check verdict) is added below.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PACK_NODES = new Set([
  "H3FusedNVFP4Loader",
  "H3FusedNVFP4Patch",
  "H3FusedNVFP4Toggle",
  "H3FusedNVFP4Calibrate",
  "H3FusedNVFP4SaveCalibrated",
]);
const WIDGET_NAME = "h3_decision";
const PROP_DECISION = "h3_decision"; // node.properties: the text the node returned at its last run
const PROP_PROGRESS = "h3_progress"; // node.properties: progress text received after that run (block self-check)
const PROGRESS_PREFIX = "H3 fused NVFP4:";
const LINE_PX = 15;
const MAX_BOX_PX = 220;

function outputText(output) {
  const text = output?.text;
  if (Array.isArray(text)) return text.filter((t) => typeof t === "string").join("\n");
  return typeof text === "string" ? text : "";
}

function displayText(node) {
  const props = node.properties ?? {};
  return [props[PROP_DECISION], props[PROP_PROGRESS]].filter((t) => typeof t === "string" && t).join("\n");
}

function boxHeight(text) {
  const lines = text.split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / 60)), 0);
  return Math.min(MAX_BOX_PX, Math.max(44, lines * LINE_PX + 14));
}

function findWidget(node) {
  return node.widgets?.find((w) => w.name === WIDGET_NAME);
}

function ensureWidget(node) {
  const existing = findWidget(node);
  if (existing) return existing;
  if (typeof node.addDOMWidget !== "function") return null;
  const el = document.createElement("textarea");
  el.readOnly = true;
  el.spellcheck = false;
  el.className = "comfy-multiline-input h3-fused-nvfp4-decision";
  el.dataset.h3Decision = "";
  Object.assign(el.style, { opacity: "0.85", fontSize: "11px", lineHeight: `${LINE_PX}px`, resize: "none" });
  const widget = node.addDOMWidget(WIDGET_NAME, "h3_decision_text", el, {
    serialize: false,
    hideOnZoom: true,
    getValue: () => el.value,
    setValue: (v) => {
      el.value = typeof v === "string" ? v : "";
    },
    getMinHeight: () => boxHeight(el.value),
    getMaxHeight: () => MAX_BOX_PX,
  });
  widget.serialize = false; // not in the workflow's widgets_values
  if (widget.options) widget.options.serialize = false; // not in the prompt sent to the server
  widget.h3Element = el;
  return widget;
}

function render(node) {
  const text = displayText(node);
  if (!text && !findWidget(node)) return;
  const widget = ensureWidget(node);
  if (!widget) return;
  widget.value = text;
  const el = widget.h3Element ?? widget.element;
  if (el) el.value = text;
  const [w, h] = node.size ?? [0, 0];
  const min = node.computeSize?.() ?? [w, h];
  if (min[1] > h || min[0] > w) node.setSize?.([Math.max(w, min[0]), Math.max(h, min[1])]);
  node.setDirtyCanvas?.(true, true);
}

function setDecision(node, text) {
  node.properties ??= {};
  node.properties[PROP_DECISION] = text;
  delete node.properties[PROP_PROGRESS];
  render(node);
}

function setProgress(node, text) {
  node.properties ??= {};
  node.properties[PROP_PROGRESS] = text;
  render(node);
}

function findGraphNode(executionId) {
  const graph = app.graph ?? app.canvas?.graph;
  if (!graph || executionId == null) return null;
  const id = String(executionId);
  if (!id.includes(":")) return graph.getNodeById?.(id) ?? graph.getNodeById?.(Number(id)) ?? null;
  // "outer:inner" ids of nodes inside subgraphs: follow the path through the subgraph nodes
  let current = app.rootGraph ?? graph;
  let node = null;
  for (const part of id.split(":")) {
    node = current?.getNodeById?.(part) ?? current?.getNodeById?.(Number(part)) ?? null;
    if (!node) return null;
    current = node.subgraph ?? null;
  }
  return node;
}

app.registerExtension({
  name: "H3FusedNVFP4.DecisionText",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!PACK_NODES.has(nodeData?.name)) return;

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const result = onExecuted?.apply(this, arguments);
      const text = outputText(output);
      if (text) setDecision(this, text);
      return result;
    };

    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const result = onConfigure?.apply(this, arguments);
      render(this); // a saved workflow: show the text stored with the node
      return result;
    };
  },

  setup() {
    api.addEventListener("progress_text", (event) => {
      const { nodeId, text } = event?.detail ?? {};
      if (typeof text !== "string" || !text.startsWith(PROGRESS_PREFIX)) return;
      const node = findGraphNode(nodeId);
      if (node && PACK_NODES.has(node.type ?? node.comfyClass)) setProgress(node, text);
    });
  },
});
