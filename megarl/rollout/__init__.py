"""Rollout engines: vLLM and HF backends behind one async interface, an HTTP server/client, a router.

Heavy dependencies (vLLM, transformers) are imported only by the backend
module chosen, so importing ``megarl.rollout.client`` stays cheap.
"""
