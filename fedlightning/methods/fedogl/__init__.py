"""FedOGL: replay and task-start distillation, structure-basis gradient projection
(Eqs. 7-9), prototype memory with prototype-graph refinement (Eqs. 10-14), MSP rejection
(Eq. 6); node classification and cross-modal retrieval (docs/fedogl.md)."""
