// H3 Fused NVFP4: shows each pack node's decision text on the node.
//
// The nodes return their decision as UI text (ui.PreviewText): "patched N blocks ...", or why ComfyUI's own path
// runs. They are not output nodes, so nothing in ComfyUI's frontend draws it. This extension puts it in a
// read-only text box below the node's widgets, sized to show the whole text at the node's width, updates it when
// the node runs, and keeps it in the node's properties so that it is still there when the workflow is saved and
// reopened. The text box never enters the workflow's widgets_values nor the prompt sent to the server
// (serialize: false), so widget order and caching are unchanged. Progress text the pack sends while a model runs
// (the block self-check verdict) is added below.
//
// A run ComfyUI serves from its execution cache runs no node: the server sends each pack node's cached text again
// (the nodes declare has_intermediate_output); the box then says that the result was reused, and the browser's
// console logs it. Workflows with this pack's nodes opened from the Templates dialog keep the view they were saved
// with (see keepSavedViewOfTemplates).

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
const PROP_CACHED = "h3_cached"; // node.properties: true when the last run served the node from ComfyUI's cache
const CACHED_NOTE = "(this run reused the node's result of an earlier run from ComfyUI's cache)";
const PROGRESS_PREFIX = "H3 fused NVFP4:";
const LINE_PX = 15;
const FONT_PX = 11;
const MIN_BOX_PX = 44;
const MAX_BOX_PX = 360; // longer texts scroll inside the box
// The frontend lays a DOM widget out in a slot of the height it asks for and insets its element by the widget's
// margin on every side (its own default where the widget has none).
const WIDGET_MARGIN_PX = 10;

function outputText(output) {
  const text = output?.text;
  if (Array.isArray(text)) return text.filter((t) => typeof t === "string").join("\n");
  return typeof text === "string" ? text : "";
}

function displayText(node) {
  const props = node.properties ?? {};
  const lines = [props[PROP_DECISION], props[PROP_PROGRESS], props[PROP_CACHED] === true ? CACHED_NOTE : null];
  return lines.filter((t) => typeof t === "string" && t).join("\n");
}

// The height the text takes in the box at the box's width, wrapped as the browser wraps it: an off-screen element
// with the text box's font, padding and wrapping rules (a textarea wraps like pre-wrap + break-word). Measured once
// per text, width and font, as the frontend asks for the box's height on every layout.
let measurer = null;
const measured = new Map();

function textHeight(text, width, el) {
  const style = el?.isConnected ? getComputedStyle(el) : null; // the frontend's font, once the box is in the page
  const font = {
    fontFamily: style?.fontFamily || "monospace",
    padding: style?.padding || "2px",
    letterSpacing: style?.letterSpacing || "normal",
  };
  const key = [width, font.fontFamily, font.padding, font.letterSpacing, text].join("\u0000");
  if (measured.has(key)) return measured.get(key);
  if (!measurer) {
    measurer = document.createElement("div");
    measurer.setAttribute("aria-hidden", "true");
    Object.assign(measurer.style, {
      position: "absolute", left: "-10000px", top: "0", visibility: "hidden", pointerEvents: "none",
      whiteSpace: "pre-wrap", overflowWrap: "break-word", boxSizing: "border-box",
    });
  }
  if (!measurer.isConnected) document.body.appendChild(measurer);
  Object.assign(measurer.style, font, { width: `${width}px`, fontSize: `${FONT_PX}px`, lineHeight: `${LINE_PX}px` });
  measurer.textContent = text;
  const height = measurer.offsetHeight;
  if (measured.size > 200) measured.clear();
  measured.set(key, height);
  return height;
}

function widgetMargin(widget) {
  return typeof widget?.margin === "number" ? widget.margin : WIDGET_MARGIN_PX;
}

function boxWidth(node, widget) {
  // the width the frontend gives the box (the element's own width lags behind: it is set when the node is drawn)
  const width = typeof widget?.width === "number" ? widget.width : node.size?.[0] ?? 300;
  return Math.max(40, width - 2 * widgetMargin(widget));
}

// The widget's slot: the text's height in the box, within [MIN_BOX_PX, MAX_BOX_PX], plus the margins around it.
// The text is the node's (the box's own value reaches it through the frontend's widget store, a frame later in some
// versions, after the layout has been computed).
function slotHeight(node, widget, el) {
  const text = displayText(node);
  const box = text ? Math.ceil(textHeight(text, boxWidth(node, widget), el)) + 2 : MIN_BOX_PX;
  return Math.min(MAX_BOX_PX, Math.max(MIN_BOX_PX, box)) + 2 * widgetMargin(widget);
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
  Object.assign(el.style, {
    opacity: "0.85", fontSize: `${FONT_PX}px`, lineHeight: `${LINE_PX}px`, resize: "none", overflowY: "auto",
  });
  let widget = null; // the frontend may lay the node out inside addDOMWidget, before it returns the widget
  widget = node.addDOMWidget(WIDGET_NAME, "h3_decision_text", el, {
    serialize: false,
    hideOnZoom: true,
    getValue: () => el.value,
    setValue: (v) => {
      el.value = typeof v === "string" ? v : "";
    },
    getMinHeight: () => slotHeight(node, widget, el),
    getMaxHeight: () => slotHeight(node, widget, el), // the frontend grows a box to its maximum where it can
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
  app.canvas?.setDirty?.(true, true); // the node's own call does not redraw in every frontend version
}

function setDecision(node, text) {
  node.properties ??= {};
  // the progress text belongs to the model this decision made: a new decision starts without it
  if (node.properties[PROP_DECISION] !== text) delete node.properties[PROP_PROGRESS];
  node.properties[PROP_DECISION] = text;
  render(node);
}

function setCached(node, cached) {
  node.properties ??= {};
  if (cached) node.properties[PROP_CACHED] = true;
  else delete node.properties[PROP_CACHED];
  render(node);
}

function isPackNode(node) {
  return !!node && PACK_NODES.has(node.type ?? node.comfyClass);
}

function hasPackNodes(graphData) {
  const graphs = [graphData, ...(graphData?.definitions?.subgraphs ?? [])];
  return graphs.some((g) => Array.isArray(g?.nodes) && g.nodes.some((n) => PACK_NODES.has(n?.type)));
}

// Opened from the Templates dialog, a workflow is fitted whole into the view (the frontend does so for every
// template, ignoring the view saved with it): this pack's examples, wide graphs with their notes beside them, would
// open at about a third of their size, too small to read. A template with this pack's nodes and a saved view is
// loaded as the same file opened from disk is: with its saved view (where the user's settings restore views).
function keepSavedViewOfTemplates() {
  const load = app.loadGraphData;
  if (typeof load !== "function" || load.h3KeepsSavedView) return;
  const loadGraphData = function (graphData, clean, restoreView, workflow, options) {
    if (options?.openSource === "template" && graphData?.extra?.ds && hasPackNodes(graphData)) {
      const { openSource, ...asFromFile } = options;
      return load.call(this, graphData, clean, restoreView, workflow, asFromFile);
    }
    return load.apply(this, arguments);
  };
  loadGraphData.h3KeepsSavedView = true;
  app.loadGraphData = loadGraphData;
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

  init() {
    keepSavedViewOfTemplates();
  },

  setup() {
    api.addEventListener("progress_text", (event) => {
      const { nodeId, text } = event?.detail ?? {};
      if (typeof text !== "string" || !text.startsWith(PROGRESS_PREFIX)) return;
      const node = findGraphNode(nodeId);
      if (isPackNode(node)) setProgress(node, text);
    });

    // The nodes a prompt's run serves from ComfyUI's cache ("execution_cached" comes first), then each node's
    // "executed" message: its text, fresh or cached (onExecuted above shows the text itself).
    let cachedRun = { promptId: null, nodes: new Set() };
    api.addEventListener("execution_cached", (event) => {
      const { nodes, prompt_id: promptId } = event?.detail ?? {};
      cachedRun = { promptId, nodes: new Set((nodes ?? []).map(String)) };
    });
    api.addEventListener("executed", (event) => {
      const { node: executionId, display_node: displayId, output, prompt_id: promptId } = event?.detail ?? {};
      const text = outputText(output);
      const node = findGraphNode(displayId ?? executionId);
      if (!text || !isPackNode(node)) return;
      const cached = promptId != null && promptId === cachedRun.promptId && cachedRun.nodes.has(String(executionId));
      setCached(node, cached);
      if (cached) {
        console.info(`H3 fused NVFP4: node #${displayId ?? executionId} (${node.title ?? node.type}) was served ` +
                     `from ComfyUI's cache: no model was loaded or patched for this run; its text is the run's ` +
                     `that made the model: ${text}`);
      }
    });
  },
});
