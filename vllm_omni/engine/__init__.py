"""The multi-stage control plane: AsyncOmniEngine -> Orchestrator -> StagePool -> stage clients."""
