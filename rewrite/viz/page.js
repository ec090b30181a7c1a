"use strict";
// The viewer of one recording (rewrite/viz): everything it shows is in the two JSON blocks above; it fetches nothing.
const D = JSON.parse(document.getElementById("graft-data").textContent);
const NODES = D.nodes, RULES = D.rules;
let SVGS = [];   // the drawings, unpacked (gzip, base64) before the page starts: see start() at the end
async function unpack(text) {
  if (!text.trim()) return [];
  const bytes = Uint8Array.from(atob(text.trim()), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return (await new Response(stream).text()).split("\0");
}

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") e.addEventListener("click", v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}
const ms = (s) => (s * 1e3).toFixed(s < 1e-3 ? 3 : 2) + " ms";
const nodeText = (n) => n === null || n === undefined ? "(none)" : `#${n} ${NODES[n][0]} ${NODES[n][1]}${NODES[n][2] ? " " + NODES[n][2] : ""}`;
const countNodes = (root) => {
  if (root === null || root === undefined) return 0;
  const seen = new Set([root]), stack = [root];
  while (stack.length) for (const s of NODES[stack.pop()][3]) if (!seen.has(s)) { seen.add(s); stack.push(s); }
  return seen.size;
};

// ---- every scope and rewrite, numbered in document order (the page's address: #rw=N&step=K or #scope=N)
const scopes = [], rewrites = [];
(function index(scope, parent) {
  scope.parent = parent; scope.id = scopes.length; scopes.push(scope);
  for (const item of scope.items) {
    if (item.items) index(item, scope);
    else { item.parent = scope; item.id = rewrites.length; rewrites.push(item); }
  }
})(D.root, null);
const kernelsOf = (s) => s.items.filter((i) => i.kind === "kernel");
const rewritesOf = (s) => s.items.filter((i) => !i.items);
const scopeTitle = (s) => s.kind === "session" ? "session" : `${s.kind} ${s.name}`;

// ---- the navigation tree: realize -> its stages and kernels -> a kernel's stages
const nav = document.getElementById("nav"), view = document.getElementById("view");
let selected = null;
function select(elem) { if (selected) selected.classList.remove("sel"); selected = elem; if (elem) elem.classList.add("sel"); }
const navOf = new Map();   // scope or rewrite -> its element in the tree

function stageEntry(r) {
  const e = el("div", { class: "nav-stage" + (r.steps.length ? "" : " idle"), title: `${r.steps.length} rule applications` },
    r.stage, el("span", { class: "n", text: `  ${r.steps.length}` }), r.error ? el("span", { class: "err", text: " !" }) : null);
  e.addEventListener("click", () => showRewrite(r, r.steps.length ? 1 : 0));
  navOf.set(r, e);
  return e;
}
function scopeEntry(s, ordinal) {
  const d = el("details", { class: "nav-" + s.kind });
  const label = s.kind === "kernel" ? scopeTitle(s) : `${s.kind} ${ordinal}: ${s.name}`;
  const sum = el("summary", { text: label });
  sum.addEventListener("click", (ev) => { if (ev.offsetX > 14) { ev.preventDefault(); d.open = true; showScope(s); } });
  d.append(sum);
  navOf.set(s, sum);
  let filled = false;
  const fill = () => {   // a kernel's entries are made when it is first opened: a big model has hundreds
    if (filled) return; filled = true;
    let n = 0;
    for (const item of s.items) d.append(item.items ? scopeEntry(item, ++n) : stageEntry(item));
  };
  d.addEventListener("toggle", fill);
  d.fill = fill;
  if (s.kind !== "kernel") { d.open = true; fill(); }   // a realize (or a plan) opens at once
  return d;
}
function buildNav() {
  let n = 0;
  for (const item of D.root.items) nav.append(item.items ? scopeEntry(item, ++n) : stageEntry(item));
  const realizes = D.root.items.filter((i) => i.kind === "realize" || i.kind === "plan");
  const kernels = scopes.filter((s) => s.kind === "kernel").length;
  document.getElementById("summary").textContent =
    `${D.command} · ${realizes.length} realizes, ${kernels} kernels, ${rewrites.length} rewrites, ${NODES.length} nodes · ${D.note || ""}`;
}
function reveal(thing) {   // open the tree down to a scope or rewrite
  const chain = [];
  for (let s = thing.parent; s; s = s.parent) chain.unshift(s);
  for (const s of chain) { const e = navOf.get(s); if (e) { e.parentElement.open = true; e.parentElement.fill(); } }
  const e = navOf.get(thing);
  if (e) { select(e); e.scrollIntoView({ block: "nearest" }); }
}

// ---- scope views: a realize (its host program, stages and kernels) and a kernel (its source, plan, timing, stages)
function rulesFired(r) {
  const counts = new Map();
  for (const s of r.steps) counts.set(s[0], (counts.get(s[0]) || 0) + 1);
  return [...counts.entries()].sort((a, b) => b[1] - a[1]);
}
function stageTable(list) {
  const t = el("table", { class: "stages" }, el("tr", {}, ...["stage", "nodes before → after", "rule applications", "rules that fired", "time"].map((h) => el("th", { text: h }))));
  for (const r of list) {
    const fired = rulesFired(r).map(([i, c]) => `${RULES[i].name} ×${c}`).join(", ");
    const row = el("tr", { class: "clickable" }, el("td", { text: r.stage }),
      el("td", { text: `${countNodes(r.before)} → ${countNodes(r.after)}` }), el("td", { text: String(r.steps.length) }),
      el("td", { text: fired + (r.nested.length ? `  (+${r.nested.length} nested rewrites)` : "") }), el("td", { text: ms(r.seconds) }));
    row.addEventListener("click", () => showRewrite(r, r.steps.length ? 1 : 0));
    t.append(row);
  }
  return t;
}
function timing(name) {
  const t = (D.kernel_times || {})[name];
  if (!t || !t.length) return "not run while recording";
  const sorted = [...t].sort((a, b) => a - b);
  return `${t.length} runs: first ${ms(t[0])}, median ${ms(sorted[Math.floor(sorted.length / 2)])}, best ${ms(sorted[0])}`;
}
function showScope(s) {
  reveal(s);
  history.replaceState(null, "", "#scope=" + s.id);
  view.replaceChildren(el("h2", { text: scopeTitle(s) }));
  if (s.kind === "kernel") {
    const a = s.attrs;
    view.append(el("p", {}, el("b", { text: "plan: " }), a.plan || "(none)", el("br"), el("b", { text: "timing: " }), timing(s.name),
      el("br"), el("b", { text: "work: " }), `${a.flops} flops, ${a.bytes} bytes on ${a.device}`));
  }
  if (s.attrs.program) view.append(el("h3", { text: "host program" }), el("pre", { class: "program", text: s.attrs.program }));
  const own = rewritesOf(s);
  if (own.length) view.append(el("h3", { text: "stages (click one to step through its rewrites)" }), stageTable(own));
  const ks = kernelsOf(s);
  if (ks.length) {
    const t = el("table", { class: "kernels" }, el("tr", {}, ...["kernel", "plan", "timing", "stages"].map((h) => el("th", { text: h }))));
    for (const k of ks) {
      const row = el("tr", { class: "clickable" }, el("td", { text: k.name }), el("td", { text: k.attrs.plan || "" }),
        el("td", { text: timing(k.name) }), el("td", { text: String(rewritesOf(k).length) }));
      row.addEventListener("click", () => showScope(k));
      t.append(row);
    }
    view.append(el("h3", { text: "kernels" }), t);
  }
  if (s.attrs.source) view.append(el("h3", { text: "generated source" }), el("pre", { class: "source", text: s.attrs.source }));
}

// ---- a rewrite: its graphs before and after, and its rule applications one at a time
function graphPane(title, pages, marks) {
  // pages: indices into SVGS; shows one page at a time (the one holding the first marked node, else the last)
  const box = el("div", { class: "graph" }), bar = el("div", { class: "bar" }, el("b", { text: title + " " }));
  const pane = el("div", { class: "pane" }, bar, box);
  if (!pages.length) { box.append(el("p", { class: "muted", text: "(no drawing: see the note at the top)" })); return pane; }
  let at = pages.length - 1;
  for (const [n] of marks) { const i = pages.findIndex((p) => SVGS[p].includes(`"node u${n}"`)); if (i >= 0) { at = i; break; } }
  const buttons = pages.length > 1 ? pages.map((_, i) => el("button", { text: String(i + 1), onclick: () => show(i) })) : [];
  if (buttons.length) bar.append(`page `, ...buttons, el("span", { class: "muted", text: ` of ${pages.length}` }));
  let fit = false;
  const fitButton = el("button", { class: "fit", text: "fit", title: "the whole page of the graph in the pane, or its natural size",
    onclick: () => { fit = !fit; fitButton.classList.toggle("on", fit); show(at); } });
  bar.append(" ", fitButton);
  function show(i) {
    at = i;
    buttons.forEach((b, j) => b.classList.toggle("on", j === i));
    box.innerHTML = SVGS[pages[i]];
    const svg = box.querySelector("svg");
    if (fit && svg) { svg.setAttribute("width", "100%"); svg.removeAttribute("height"); }
    let first = null;
    for (const [n, cls] of marks) for (const g of box.querySelectorAll(`g.u${n}`)) { g.classList.add(cls); first = first || g; }
    // the marked node in view, else the graph's root (at the bottom, in the middle): the pane scrolls, not the page
    // (once the pane is in the page and laid out: the next frame)
    requestAnimationFrame(() => {
      const target = first ? first.getBoundingClientRect() : null, frame = box.getBoundingClientRect();
      if (target) { box.scrollLeft += target.left - frame.left - frame.width / 2; box.scrollTop += target.top - frame.top - frame.height / 2; }
      else { box.scrollLeft = (box.scrollWidth - box.clientWidth) / 2; box.scrollTop = box.scrollHeight; }
    });
  }
  show(at);
  return pane;
}
function showRewrite(r, step) {
  reveal(r);
  step = Math.max(0, Math.min(step, r.steps.length));
  history.replaceState(null, "", `#rw=${r.id}&step=${step}`);
  const where = r.parent && r.parent.kind !== "session" ? ` — ${scopeTitle(r.parent)}` : "";
  view.replaceChildren(el("h2", { id: "stage-title", text: `stage ${r.stage}${where}` }),
    el("p", { class: "muted", text: `${countNodes(r.before)} nodes → ${countNodes(r.after)} nodes, ${r.steps.length} rule applications, ` +
      `${ms(r.seconds)} (recording), ${r.top_down ? "top-down" : "bottom-up"}` }));
  if (r.error) view.append(el("p", { class: "err", text: r.error }));
  const fired = rulesFired(r);
  if (fired.length) {
    const t = el("table", { class: "rules" }, el("tr", {}, ...["rule", "where", "applications"].map((h) => el("th", { text: h }))));
    for (const [i, c] of fired) {
      const row = el("tr", { class: "clickable", title: "step to its first application" }, el("td", { text: RULES[i].name }),
        el("td", { class: "loc", text: RULES[i].location }), el("td", { text: String(c) }));
      row.addEventListener("click", () => showRewrite(r, r.steps.findIndex((s) => s[0] === i) + 1));
      t.append(row);
    }
    view.append(el("h3", { text: "rules that fired" }), t);
  }
  // the step panel: step 0 is the stage as a whole
  const s = step ? r.steps[step - 1] : null;
  const panel = el("div", { id: "steps" });
  const go = (k) => () => showRewrite(r, k);
  panel.append(el("button", { id: "first", text: "whole stage", title: "the stage as a whole", onclick: go(0) }),
    el("button", { id: "prev", text: "◀", title: "previous rule application (←)", onclick: go(step - 1) }),
    el("span", { id: "step-index", text: ` step ${step} of ${r.steps.length} ` }),
    el("button", { id: "next", text: "▶", title: "next rule application (→)", onclick: go(step + 1) }));
  if (s) {
    const rule = RULES[s[0]];
    panel.append(el("div", {}, "rule ", el("span", { id: "step-rule", text: rule.name }), " at ", el("span", { id: "step-loc", class: "loc", text: rule.location }),
      el("span", { class: "muted", text: `  (${ms(s[5])})` })),
      el("div", {}, "matched ", el("code", { text: nodeText(s[1]) }), "  →  returned ", el("code", { text: nodeText(s[2]) }),
        el("span", { class: "muted", text: `, ${s[4] - s[3]} new nodes` })),
      el("div", { class: "legend" }, el("span", { style: "border-color:#d32f2f", text: "matched" }),
        el("span", { style: "border-color:#1565c0", text: "result" }), el("span", { style: "border-color:#a5f0a0;background:#a5f0a0", text: "new" })));
    const drawn = r.step_draw && r.step_draw[step - 1];
    if (drawn !== undefined) { const g = el("div", { id: "step-graph" }); g.innerHTML = SVGS[drawn]; panel.append(g); }
    else panel.append(el("p", { class: "muted", text: "(this step is not drawn: only the first steps of a stage are)" }));
    panel.append(el("details", { open: "" }, el("summary", { text: "the rule's source" }), el("pre", { id: "step-source", text: rule.source || "(source not available)" })));
  } else panel.append(el("p", { class: "muted", text: "The whole stage: ▶ steps through each rule application, in the order the rules fired." }));
  view.append(panel);
  const before = [], after = [];
  if (s) {
    before.push([s[1], "hl-matched"]);
    after.push([s[2], "hl-result"]);
    for (let n = s[3]; n < s[4]; n++) after.push([n, "hl-new"]);
  }
  if (r.draw) view.append(el("div", { class: "graphs" }, graphPane("before", r.draw[0], before), graphPane("after", r.draw[1], after)));
  else view.append(el("h3", { text: "after" }), el("pre", { text: textGraph(r.after) }));
  if (r.nested.length) {
    const d = el("details", {}, el("summary", { text: `${r.nested.length} rewrites called by this stage's rules` }));
    for (const n of r.nested) d.append(el("div", { text: `${n.stage}: ` + rulesFired(n).map(([i, c]) => `${RULES[i].name} (${RULES[i].location}) ×${c}`).join(", ") }));
    view.append(d);
  }
  currentKeys = (dir) => showRewrite(r, step + dir);
}
function textGraph(root) {
  if (root === null || root === undefined) return "(none)";
  const ids = [], seen = new Set([root]), stack = [root];
  while (stack.length) { const n = stack.pop(); ids.push(n); for (const s of NODES[n][3]) if (!seen.has(s)) { seen.add(s); stack.push(s); } }
  ids.sort((a, b) => a - b);
  return ids.slice(0, 2000).map((n) => `${nodeText(n)}  ← ${NODES[n][3].map((s) => "#" + s).join(" ")}`).join("\n");
}

let currentKeys = null;
document.addEventListener("keydown", (e) => {
  if (!currentKeys || e.target.tagName === "INPUT") return;
  if (e.key === "ArrowRight" || e.key === "j") { e.preventDefault(); currentKeys(1); }
  if (e.key === "ArrowLeft" || e.key === "k") { e.preventDefault(); currentKeys(-1); }
});

// ---- the address: #rw=N&step=K opens a rewrite at a step, #scope=N a realize or kernel; else the first realize
(async function start() {
  SVGS = await unpack(document.getElementById("graft-svgs").textContent);
  buildNav();
  const h = new URLSearchParams(location.hash.slice(1));
  if (h.has("rw") && rewrites[+h.get("rw")]) showRewrite(rewrites[+h.get("rw")], +(h.get("step") || 0));
  else if (h.has("scope") && scopes[+h.get("scope")]) showScope(scopes[+h.get("scope")]);
  else if (scopes.length > 1) showScope(scopes[1]);
  document.body.dataset.ready = "1";   // for whoever waits for the page (the browser test)
})();
