// The status view: what /info reports (model, backend, dtype, context, KV cache, requests, sleeping).

function row(list, name, value) {
  const term = document.createElement("dt");
  const detail = document.createElement("dd");
  term.textContent = name;
  detail.textContent = value;
  list.append(term, detail);
  return detail;
}

/** The rows of `info` into the <dl> `list`. */
export function renderStatus(info, list) {
  list.replaceChildren();
  const kv = info.kv_cache;
  const dtype = info.quantization && info.quantization !== "none" ? `${info.dtype}, packed ${info.quantization}` : info.dtype;
  row(list, "Model", `${info.model} (${info.architecture})`);
  row(list, "Backend", info.backend);
  row(list, "Data type", dtype);
  row(list, "Context", `${info.max_model_len.toLocaleString("en")} tokens`);
  const usage = row(list, "KV cache", `${(kv.usage * 100).toFixed(1)}% (${kv.used_blocks} of ${kv.total_blocks} blocks)`);
  const meter = document.createElement("meter");
  meter.value = kv.usage;
  meter.setAttribute("aria-label", "KV cache usage");
  usage.prepend(meter);
  const requests = row(list, "Requests", `${info.requests.running} running, ${info.requests.waiting} waiting`);
  requests.dataset.running = String(info.requests.running);
  row(list, "Sleeping", info.is_sleeping ? "yes" : "no");
  row(list, "Images", info.vision ? "yes (vision model)" : "no");
}
