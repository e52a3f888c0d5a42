"""What a sampling run is, read from ComfyUI's objects: its sigma schedule, sampler name and shift."""


def sigma_schedule(sigmas) -> tuple | None:
    """The run's sigma schedule as plain floats (recorded with an entry, and how a hit addresses it)."""
    return None if sigmas is None else tuple(float(s) for s in sigmas.detach().float().cpu().tolist())


def sampler_name(sampler) -> str:
    """k-diffusion sampler name of a KSAMPLER (``sample_euler`` -> ``euler``), else its type."""
    function = getattr(sampler, "sampler_function", None)
    name = getattr(function, "__name__", "") or type(sampler).__name__
    return name.removeprefix("sample_")


def model_shift(model_patcher) -> float:
    # get_model_object sees object patches (ModelSamplingSD3 sets model_sampling as one)
    sampling = model_patcher.get_model_object("model_sampling") if hasattr(model_patcher, "get_model_object") \
        else getattr(model_patcher.model, "model_sampling", None)
    return float(getattr(sampling, "shift", 0.0) or 0.0)
