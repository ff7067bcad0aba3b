"""The README's strategy-cost table is the cost model's output for the GPU configs, not a copy of it by hand."""
from megarl.launch import cost_table


def test_readme_table_is_what_the_cost_model_says():
    assert cost_table.readme_table() == cost_table.render(), (
        "README.md's cost table differs from the cost model: regenerate it with python -m megarl.launch.cost_table")


def test_critical_path_seconds_add_forwards_copies_and_the_scorers_excess():
    # 0.5 s of copies, of which 0.375 s on the critical path (the rest overlaps the update)
    c = {"trainer_forward_s_per_step": 1.0, "pcie_s_per_step": 0.5, "pcie_critical_s_per_step": 0.5,
         "dedicated_critical_s_per_step": 0.25}
    assert cost_table.critical_s(c) == 1.75
    assert cost_table.critical_s({**c, "pcie_critical_s_per_step": 0.375}) == 1.625
    row = {**c, "pcie_bytes_per_gpu_per_step": 2e9, "host_bytes_per_trainer_node": 3e9, "dedicated_gpus": 0,
           "stall_s_per_publish": 0.4}
    assert cost_table.cell(row, baseline=3.5) == (
        "+1.75 s / step (50%); PCIe 2 GB / GPU (0.5 s, 0.5 on the critical path); host 3 GB / node; "
        "stall 0.4 s / publish")
