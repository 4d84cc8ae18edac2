// The conversation's messages as elements: user text and images as sent; replies with their reasoning
// folded, Markdown content (rendered safely), tool calls, errors and how they ended; the actions on the
// last turn (edit the last user message, regenerate the last reply) as buttons with a data-action.

import { renderMarkdown } from "./markdown.js";

const ENDINGS = {
  length: "Stopped at the token limit.",
  stopped: "Stopped.",
  abort: "Aborted by the server.",
};

function element(tag, parent, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  parent?.append(node);
  return node;
}

function button(parent, action, text, label) {
  const node = element("button", parent, "action", text);
  node.type = "button";
  node.dataset.action = action;
  node.setAttribute("aria-label", label);
  return node;
}

/** A new, empty element for one message (fill it with `fillMessage`). */
export function messageElement() {
  return element("article", null, "message");
}

/** (Re)draw `message` into `node`; `last` says whether it is the last user turn or the last reply, and
 * `streaming` whether tokens are still arriving. An open reasoning fold stays open. */
export function fillMessage(node, message, { last = false, streaming = false } = {}) {
  const wasOpen = node.querySelector("details.reasoning")?.open ?? false;
  node.className = `message ${message.role}${streaming ? " streaming" : ""}`;
  node.replaceChildren();
  element("div", node, "role", message.role === "user" ? "You" : "Assistant");
  if (message.role === "user") userBody(node, message);
  else replyBody(node, message, wasOpen, streaming);
  if (last && !streaming) actions(node, message);
}

function userBody(node, message) {
  if (message.images?.length) {
    const images = element("div", node, "images");
    for (const url of message.images.filter((u) => u.startsWith("data:image/"))) {
      const image = element("img", images);
      image.src = url;
      image.alt = "attached image";
    }
  }
  element("div", node, "content plain", message.content);
}

function replyBody(node, message, wasOpen, streaming) {
  if (message.reasoning) {
    const fold = element("details", node, "reasoning");
    fold.open = wasOpen;
    element("summary", fold, "", streaming && !message.content ? "Thinking…" : "Reasoning");
    element("div", fold, "reasoning-text").append(renderMarkdown(message.reasoning));
  }
  element("div", node, "content").append(renderMarkdown(message.content));
  for (const call of message.tool_calls ?? []) toolCall(node, call);
  if (message.error) element("div", node, "error", message.error).setAttribute("role", "alert");
  const ending = ENDINGS[message.finish];
  if (ending) element("div", node, "ending", ending);
}

function toolCall(node, call) {
  const box = element("div", node, "tool-call");
  const title = element("div", box, "tool-title", "Tool call ");
  element("code", title, "tool-name", call.function.name);
  let args = call.function.arguments;
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch { /* still streaming, or not JSON: as sent */ }
  element("code", element("pre", box), "", args);
}

function actions(node, message) {
  const bar = element("div", node, "actions");
  if (message.role === "user") button(bar, "edit", "Edit", "Edit your last message");
  else button(bar, "regenerate", "Regenerate", "Regenerate the last reply");
}
