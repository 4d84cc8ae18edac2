// Images the user attaches (file picker or paste), read as data URIs: what the server takes inline.

/** Data URIs of the image files among `files`. */
export function readImages(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  return Promise.all(images.map((file) => new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  })));
}

/** The image files of a paste event's clipboard. */
export function pastedImages(event) {
  return [...(event.clipboardData?.items ?? [])]
    .filter((item) => item.kind === "file" && item.type.startsWith("image/"))
    .map((item) => item.getAsFile()).filter(Boolean);
}
