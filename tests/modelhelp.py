"""The model's own attention, for tests that check what the loop gives the policies."""


def eager_attentions(mdl, ids) -> tuple:
    """Every layer's attention weights (1, query heads, T, T) from one eager forward pass with
    output_attentions, the model's attention implementation restored after."""
    import torch

    previous = mdl.config._attn_implementation
    mdl.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return mdl(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        mdl.set_attn_implementation(previous)
