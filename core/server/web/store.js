// Conversations and settings in this browser's localStorage (the server keeps nothing between requests).

const CONVERSATIONS = "core-chat.conversations";
const CURRENT = "core-chat.current";
const SETTINGS = "core-chat.settings";
const TITLE_LENGTH = 48;

export const DEFAULT_SETTINGS = {
  model: "", system: "", temperature: "", top_p: "", max_tokens: "", seed: "", tools: "", apiKey: "",
};

function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

export class Store {
  constructor() {
    this.conversations = read(CONVERSATIONS, []);
    this.settings = { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
    this.currentId = localStorage.getItem(CURRENT);
    if (!this.find(this.currentId)) this.currentId = this.conversations[0]?.id ?? this.create().id;
  }

  find(id) {
    return this.conversations.find((c) => c.id === id);
  }

  get current() {
    return this.find(this.currentId);
  }

  /** A new empty conversation, made current (at the top of the list). */
  create() {
    const conversation = { id: crypto.randomUUID?.() ?? String(Date.now() + Math.random()), title: "", messages: [] };
    this.conversations.unshift(conversation);
    this.currentId = conversation.id;
    return conversation;
  }

  select(id) {
    if (this.find(id)) this.currentId = id;
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (!this.find(this.currentId)) this.currentId = this.conversations[0]?.id ?? this.create().id;
  }

  /** Write everything; false when the browser's storage is full (large images), with the reason. */
  save() {
    for (const c of this.conversations) c.title ||= titleOf(c);
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations));
      localStorage.setItem(CURRENT, this.currentId);
      localStorage.setItem(SETTINGS, JSON.stringify(this.settings));
      return { ok: true };
    } catch (error) {
      return { ok: false, reason: error.message };
    }
  }
}

function titleOf(conversation) {
  const first = conversation.messages.find((m) => m.role === "user");
  const text = first?.content.trim().replace(/\s+/g, " ") ?? "";
  return text.length > TITLE_LENGTH ? `${text.slice(0, TITLE_LENGTH - 1)}…` : text;
}
