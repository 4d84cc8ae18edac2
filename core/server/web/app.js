// The chat page: wires the store, the API, the views and the keyboard together.

import { Api } from "./api.js";
import { applyChunk, newReply, requestBody } from "./chat.js";
import { pastedImages, readImages } from "./images.js";
import { fillMessage, messageElement } from "./messages.js";
import { fillSettings, readSettings } from "./settings.js";
import { renderStatus } from "./status.js";
import { Store } from "./store.js";

const STATUS_POLL_MS = 2000;
const $ = (id) => document.getElementById(id);
const store = new Store();
const api = new Api(() => store.settings.apiKey);
const page = { info: null, controller: null, attachments: [], poll: null };

// -- drawing -----------------------------------------------------------------------------------------

function drawConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of store.conversations) {
    const item = document.createElement("li");
    item.classList.toggle("current", c.id === store.currentId);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title || "New chat";
    open.dataset.id = c.id;
    if (c.id === store.currentId) open.setAttribute("aria-current", "true");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.dataset.remove = c.id;
    remove.setAttribute("aria-label", `Delete ${open.textContent}`);
    item.append(open, remove);
    list.append(item);
  }
}

function lastIndex(messages, role) {
  return messages.map((m) => m.role).lastIndexOf(role);
}

function drawMessages() {
  const { messages } = store.current;
  const busy = Boolean(page.controller);
  const lastUser = lastIndex(messages, "user");
  const lastReply = lastIndex(messages, "assistant");
  const nodes = messages.map((message, i) => {
    const node = messageElement();
    const streaming = busy && i === messages.length - 1 && message.role === "assistant";
    fillMessage(node, message, { last: !busy && (i === lastUser || i === lastReply), streaming });
    return node;
  });
  $("messages").replaceChildren(...nodes);
  scrollToEnd(true);
}

function scrollToEnd(force) {
  const box = $("messages");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

function draw() {
  drawConversations();
  drawMessages();
}

function notice(text) {
  $("notice").textContent = text ?? "";
  $("notice").hidden = !text;
}

function remember() {
  const saved = store.save();
  if (!saved.ok) notice(`This browser could not save the conversations (${saved.reason}).`);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("messages").setAttribute("aria-busy", String(busy));
  $("state").textContent = busy ? "generating…" : page.info?.is_sleeping ? "asleep" : "";
}

// -- a turn ------------------------------------------------------------------------------------------

async function reply(conversation) {
  let body;
  try {
    body = requestBody(conversation, store.settings);
  } catch (error) {
    notice(error.message);
    return;
  }
  const message = newReply();
  conversation.messages.push(message);
  page.controller = new AbortController();
  setBusy(true);
  remember();
  draw();
  await stream(body, message, page.controller.signal);
  page.controller = null;
  setBusy(false);
  remember();
  draw();
  $("prompt").focus();
}

async function stream(body, message, signal) {
  const node = $("messages").lastElementChild;
  let frame = 0;
  const redraw = () => {
    frame = 0;
    fillMessage(node, message, { streaming: true });
    scrollToEnd(false);
  };
  try {
    for await (const chunk of api.streamChat(body, signal)) {
      applyChunk(message, chunk);
      frame ||= requestAnimationFrame(redraw);
    }
  } catch (error) {
    if (error.name === "AbortError") message.finish = "stopped";
    else failed(message, error);
  }
  cancelAnimationFrame(frame);
}

function failed(message, error) {
  message.error = error.message;
  if (error.status === 401) askForKey();
}

function send() {
  const text = $("prompt").value;
  if (page.controller || (!text.trim() && !page.attachments.length)) return;
  store.current.messages.push({ role: "user", content: text, images: page.attachments });
  $("prompt").value = "";
  setAttachments([]);
  reply(store.current);
}

function stop() {
  page.controller?.abort();
}

function regenerate() {
  const { messages } = store.current;
  if (messages.at(-1)?.role === "assistant") messages.pop();
  reply(store.current);
}

function edit() {
  const { messages } = store.current;
  const index = lastIndex(messages, "user");
  const [message] = messages.splice(index, messages.length - index);
  $("prompt").value = message.content;
  setAttachments(message.images ?? []);
  remember();
  draw();
  $("prompt").focus();
}

// -- images ------------------------------------------------------------------------------------------

function setAttachments(images) {
  page.attachments = images;
  const box = $("attachments");
  box.replaceChildren(...images.map((url, i) => {
    const chip = document.createElement("div");
    chip.className = "attachment";
    const image = document.createElement("img");
    image.src = url;
    image.alt = `attachment ${i + 1}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.dataset.index = String(i);
    remove.setAttribute("aria-label", `Remove attachment ${i + 1}`);
    chip.append(image, remove);
    return chip;
  }));
  box.hidden = !images.length;
}

async function attach(files) {
  if (!page.info?.vision) return;
  setAttachments([...page.attachments, ...await readImages(files)]);
}

// -- the server: models, status, key -----------------------------------------------------------------

async function loadServer() {
  try {
    const [models, info] = await Promise.all([api.get("/v1/models"), api.get("/info")]);
    showModels(models.data.map((m) => m.id));
    showInfo(info);
    notice(null);
  } catch (error) {
    if (error.status === 401) askForKey();
    else notice(`Cannot reach the server: ${error.message}`);
  }
}

function showModels(ids) {
  const select = $("model");
  select.replaceChildren(...ids.map((id) => new Option(id, id)));
  if (!ids.includes(store.settings.model)) store.settings.model = ids[0] ?? "";
  select.value = store.settings.model;
}

function showInfo(info) {
  page.info = info;
  $("attach").hidden = !info.vision;
  renderStatus(info, $("status-list"));
  if (!page.controller) setBusy(false);
  if (info.is_sleeping) notice("The server is asleep: requests are refused until it is woken (POST /wakeup).");
}

async function refreshStatus() {
  try {
    showInfo(await api.get("/info"));
  } catch (error) {
    if (error.status === 401) askForKey();
  }
}

function toggleStatus() {
  const open = $("status").hidden;
  $("status").hidden = !open;
  $("toggle-status").setAttribute("aria-expanded", String(open));
  clearInterval(page.poll);
  if (open) {
    refreshStatus();
    page.poll = setInterval(refreshStatus, STATUS_POLL_MS);
  }
}

function askForKey() {
  notice("This server needs an API key: enter it in Settings.");
  openSettings("apiKey");
}

// -- settings ----------------------------------------------------------------------------------------

function openSettings(focus) {
  const dialog = $("settings");
  fillSettings($("settings-form"), store.settings);
  $("settings-error").hidden = true;
  if (!dialog.open) dialog.showModal();
  if (focus) $("settings-form").elements[focus].focus();
}

function saveSettings(event) {
  event.preventDefault();
  try {
    store.settings = readSettings($("settings-form"), store.settings);
  } catch (error) {
    $("settings-error").textContent = error.message;
    $("settings-error").hidden = false;
    return;
  }
  remember();
  $("settings").close();
  loadServer();
}

// -- events ------------------------------------------------------------------------------------------

function onKey(event) {
  if (event.target.id === "prompt" && event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  } else if (event.key === "Escape" && page.controller) {
    event.preventDefault();
    stop();
  }
}

function onMessagesClick(event) {
  const action = event.target.closest("[data-action]")?.dataset.action;
  if (action === "edit") edit();
  else if (action === "regenerate") regenerate();
  else if (action === "copy-code") copyCode(event.target);
}

function copyCode(button) {
  const code = button.closest(".code-block").querySelector("code").textContent;
  navigator.clipboard?.writeText(code).then(() => {  // (no clipboard outside secure contexts)
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
}

function onConversationsClick(event) {
  const { id, remove } = event.target.dataset;
  if (page.controller && (id || remove)) return;  // finish or stop the running turn first
  if (id) store.select(id);
  if (remove) store.remove(remove);
  if (id || remove) {
    remember();
    draw();
    toggleSidebar(false);
  }
}

function newChat() {
  if (page.controller) return;
  if (store.current.messages.length) store.create();
  remember();
  draw();
  toggleSidebar(false);
  $("prompt").focus();
}

function toggleSidebar(open = !document.body.classList.contains("sidebar-open")) {
  document.body.classList.toggle("sidebar-open", open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}

function listen() {
  document.addEventListener("keydown", onKey);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("stop").addEventListener("click", stop);
  $("messages").addEventListener("click", onMessagesClick);
  $("conversations").addEventListener("click", onConversationsClick);
  $("new-chat").addEventListener("click", newChat);
  $("toggle-sidebar").addEventListener("click", () => toggleSidebar());
  $("toggle-status").addEventListener("click", toggleStatus);
  $("open-settings").addEventListener("click", () => openSettings());
  $("settings-form").addEventListener("submit", saveSettings);
  $("cancel-settings").addEventListener("click", () => $("settings").close());
  $("model").addEventListener("change", (event) => {
    store.settings.model = event.target.value;
    remember();
  });
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", (event) => attach(event.target.files).finally(() => {
    event.target.value = "";
  }));
  $("prompt").addEventListener("paste", (event) => {
    const files = pastedImages(event);
    if (files.length && page.info?.vision) {
      event.preventDefault();
      attach(files);
    }
  });
  $("attachments").addEventListener("click", (event) => {
    const { index } = event.target.dataset;
    if (index !== undefined) setAttachments(page.attachments.filter((_, i) => i !== Number(index)));
  });
}

listen();
draw();
setBusy(false);
loadServer();
$("prompt").focus();
