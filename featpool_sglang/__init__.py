"""featpool features as SGLang image inputs: ``featpool_sglang.adapter`` (docs/integrations.md)."""
