"""featpool as vLLM's encoder cache: ``featpool_vllm.connector.FeaturePoolECConnector``
(install with ``pip install 'featpool[vllm]'``)."""
