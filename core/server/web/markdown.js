// A small Markdown renderer that builds DOM nodes and never parses HTML. Model output is untrusted, so
// every character of it ends up in a text node, and a link keeps its target only when that is an
// http(s) or mailto URL: `<img src=x onerror=...>` is shown as the text it is. It covers what chat
// models write: fenced code (an unclosed fence, as while streaming, runs to the end), headings, nested
// lists, quotes, rules and paragraphs; inline code, bold, italic, strike-through, links and bare URLs.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const SAFE_URL = /^(?:https?:\/\/|mailto:)/i;
const INLINE = new RegExp([
  /\\(?<escaped>[\\`*_{}[\]()#+\-.!~>|])/,
  /(?<ticks>`+)(?<code>[\s\S]*?[^`])\k<ticks>(?!`)/,
  /\*\*(?=\S)(?<bold>[\s\S]*?\S)\*\*/,
  /__(?=\S)(?<bold2>[\s\S]*?\S)__/,
  /~~(?=\S)(?<strike>[\s\S]*?\S)~~/,
  /\*(?=[^\s*])(?<em>[\s\S]*?[^\s*])\*/,
  /(?<![\w])_(?=[^\s_])(?<em2>[\s\S]*?[^\s_])_(?![\w])/,
  /\[(?<label>[^\]\n]+)\]\(\s*<?(?<href>(?:[^\s<>()]|\([^\s<>()]*\))+)>?(?:\s+"[^"\n]*")?\s*\)/,
  /(?<url>https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"\]])/,
].map((part) => part.source).join("|"), "g");

/** The Markdown `text` as a DocumentFragment of safe elements. */
export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  renderBlocks(String(text ?? "").replace(/\r\n?/g, "\n").split("\n"), root);
  return root;
}

function element(tag, parent, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  parent.append(node);
  return node;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    const heading = HEADING.exec(line);
    if (!line.trim()) i += 1;
    else if (fence) i = codeBlock(lines, i, fence, parent);
    else if (heading) {
      renderInline(heading[2], element(`h${heading[1].length}`, parent));
      i += 1;
    } else if (RULE.test(line)) {
      element("hr", parent);
      i += 1;
    } else if (QUOTE.test(line)) i = quote(lines, i, parent);
    else if (ITEM.test(line)) i = list(lines, i, parent);
    else i = paragraph(lines, i, parent);
  }
}

function codeBlock(lines, start, fence, parent) {
  const close = new RegExp(`^ {0,3}${fence[1][0]}{${fence[1].length},}\\s*$`);
  let end = start + 1;
  while (end < lines.length && !close.test(lines[end])) end += 1;
  const block = element("div", parent, "code-block");
  const bar = element("div", block, "code-bar");
  element("span", bar, "code-lang").textContent = fence[2] || "text";
  const copy = element("button", bar, "copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.dataset.action = "copy-code";
  const code = element("code", element("pre", block));
  if (fence[2]) code.dataset.lang = fence[2];
  code.textContent = lines.slice(start + 1, end).join("\n");
  return end + 1;
}

function quote(lines, start, parent) {
  const body = [];
  let i = start;
  for (let m; i < lines.length && (m = QUOTE.exec(lines[i])); i += 1) body.push(m[1]);
  renderBlocks(body, element("blockquote", parent));
  return i;
}

function paragraph(lines, start, parent) {
  const node = element("p", parent);
  let i = start;
  while (i < lines.length && lines[i].trim() && (i === start || !startsBlock(lines[i]))) {
    if (i > start) element("br", node);
    renderInline(lines[i].trim(), node);
    i += 1;
  }
  return i;
}

const indentOf = (line) => line.length - line.trimStart().length;
const isOrdered = (marker) => /\d/.test(marker);

function list(lines, start, parent) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = isOrdered(first[2]);
  const node = element(ordered ? "ol" : "ul", parent);
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let i = start;
  for (;;) {
    while (i < lines.length && !lines[i].trim() && sameListItem(lines[i + 1], indent, ordered)) i += 1;
    const m = ITEM.exec(lines[i] ?? "");
    if (!m || !sameListItem(lines[i], indent, ordered)) return i;
    i = listItem(lines, i + 1, [m[3]], indent, element("li", node));
  }
}

function sameListItem(line, indent, ordered) {
  const m = ITEM.exec(line ?? "");
  return Boolean(m) && m[1].length === indent && isOrdered(m[2]) === ordered;
}

function listItem(lines, start, body, indent, item) {
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    const next = ITEM.exec(line);
    if (next && next[1].length <= indent) break;
    if (!line.trim()) {
      if (i + 1 >= lines.length || indentOf(lines[i + 1]) <= indent) break;
    } else if (!next && indentOf(line) <= indent && startsBlock(line)) break;
    body.push(line.slice(Math.min(indentOf(line), indent + 2)));
    i += 1;
  }
  if (body.some((l) => !l.trim())) {  // a loose item: paragraphs
    renderBlocks(body, item);
    return i;
  }
  let text = 0;  // a tight item: its text inline, then any nested blocks
  for (; text < body.length && (text === 0 || !startsBlock(body[text])); text += 1) {
    if (text) element("br", item);
    renderInline(body[text].trim(), item);
  }
  renderBlocks(body.slice(text), item);
  return i;
}

/** Inline Markdown of one line into `parent` (text nodes, code, strong, em, del, a). */
export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    parent.append(text.slice(last, m.index));
    inlineElement(m.groups, parent);
    last = m.index + m[0].length;
  }
  parent.append(text.slice(last));
}

function inlineElement(g, parent) {
  if (g.escaped !== undefined) parent.append(g.escaped);
  else if (g.code !== undefined) element("code", parent).textContent = g.code.trim() || g.code;
  else if (g.bold !== undefined || g.bold2 !== undefined) renderInline(g.bold ?? g.bold2, element("strong", parent));
  else if (g.strike !== undefined) renderInline(g.strike, element("del", parent));
  else if (g.em !== undefined || g.em2 !== undefined) renderInline(g.em ?? g.em2, element("em", parent));
  else if (g.label !== undefined && SAFE_URL.test(g.href)) renderInline(g.label, link(g.href, parent));
  else if (g.label !== undefined) renderInline(g.label, parent);  // javascript:, data:, ...: the label alone
  else link(g.url, parent).textContent = g.url;
}

function link(href, parent) {
  const a = element("a", parent);
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return a;
}
