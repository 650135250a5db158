"""FedMVP, a FedOGL baseline: PromptFormer over class text prototypes, cosine classifier
(docs/fedogl.md, "FedMVP")."""
