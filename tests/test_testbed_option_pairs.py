"""tests.testbed.option_pairs: two product-path runs that differ in one option, paired by (request, seed)."""

import json

from tests.testbed.option_pairs import main


def write_run(folder, option, psnrs):
    rows = [dict(section="matched", mask_kind="reused_similar_product", request=request, seed=seed,
                 psnr_db=psnr, density=0.2) for (request, seed), psnr in psnrs.items()]
    rows.append(dict(section="matched", mask_kind="oracle", request="r0", seed=0, psnr_db=99.0, density=0.2))
    folder.mkdir(parents=True)
    (folder / "product_path.json").write_text(json.dumps(dict(rows=rows, options={"attention_precision": option,
                                                                                  "top_p": 0.9})))


def run(tmp_path, a, b, limit="0.3"):
    write_run(tmp_path / "a", "bf16", a)
    write_run(tmp_path / "b", "fp8", b)
    main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"), "--label-a", "bf16", "--label-b", "fp8",
          "--limit-db", limit, "--out", str(tmp_path / "out")])
    return json.loads((tmp_path / "out" / "option_pairs.json").read_text())


def test_pairs_by_request_and_seed_and_judges_against_the_limit(tmp_path):
    a = {("r0", 0): 40.0, ("r0", 1): 41.0, ("r1", 0): 38.0, ("r1", 1): 39.0, ("r2", 0): 35.0, ("r2", 1): 36.0}
    b = {k: v - 0.1 + 0.02 * k[1] for k, v in a.items()}
    b[("r3", 0)] = 10.0  # a pair the other run lacks is left out
    doc = run(tmp_path, a, b)
    assert doc["pairs"] == 6 and doc["requests"] == 3
    assert abs(doc["b_minus_a_db"] - (-0.09)) < 1e-9
    assert doc["differing_options"] == {"attention_precision": [['"bf16"'], ['"fp8"']]}
    assert doc["verdict"] == "fp8 is at most 0.3 dB under bf16"
    assert "| r0 | 1 |" in (tmp_path / "out" / "option_pairs.md").read_text()


def test_a_loss_beyond_the_limit_and_a_single_request_are_not_passed(tmp_path):
    a = {("r0", 0): 40.0, ("r1", 0): 38.0, ("r2", 0): 35.0}
    assert run(tmp_path / "x", a, {k: v - 1.0 for k, v in a.items()})["verdict"] == "not shown to be within 0.3 dB"
    one = run(tmp_path / "y", {("r0", 0): 40.0, ("r0", 1): 41.0}, {("r0", 0): 40.0, ("r0", 1): 41.0})
    assert one["ci95_db"] is None and one["verdict"].startswith("not judged")
