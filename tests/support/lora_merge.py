"""A LoRA checkpoint's merged weights computed by hand, the independent reference of the export tests."""

import torch


def merged_by_hand(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor],
                   scale: float) -> dict[str, torch.Tensor]:
    """``base`` (the base model's tensors) with ``W + scale·B·A`` (scale = alpha / r; Hu et al. 2021, Eq. 3) for
    every layer ``adapter`` (peft's saved tensors, ``base_model.model.<name>.lora_A.weight`` [r, in] and
    ``lora_B.weight`` [out, r]) adapts, formed in float64 and rounded to float32."""
    expected = dict(base)
    for key, a in adapter.items():
        if ".lora_A." in key:  # base_model.model.<name>.lora_A.weight -> <name>.weight
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = adapter[key.replace("lora_A", "lora_B")]
            expected[name] = (base[name].double() + scale * b.double() @ a.double()).float()
    return expected
