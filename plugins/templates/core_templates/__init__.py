"""core-templates: sandboxed Hugging Face chat templates, named built-ins, reasoning and tool-call parsers.

The plugin module is `core_templates.plugin`; the renderer is `core_templates.jinja_template`.
"""
