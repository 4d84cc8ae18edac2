// The settings dialog: its form's fields are named after the settings they edit.

import { parseTools } from "./chat.js";
import { DEFAULT_SETTINGS } from "./store.js";

/** Put `settings` into the form's fields. */
export function fillSettings(form, settings) {
  for (const name of Object.keys(DEFAULT_SETTINGS)) {
    if (form.elements[name]) form.elements[name].value = settings[name] ?? "";
  }
}

/** The settings the form holds (the model is chosen elsewhere); throws on a field that is not valid. */
export function readSettings(form, settings) {
  const next = { ...settings };
  for (const name of Object.keys(DEFAULT_SETTINGS)) {
    const field = form.elements[name];
    if (!field) continue;
    if (field.type === "number" && !field.checkValidity()) throw new Error(`${field.dataset.label}: ${field.validationMessage}`);
    next[name] = field.value;
  }
  if (next.tools.trim()) parseTools(next.tools);
  next.apiKey = next.apiKey.trim();
  return next;
}
