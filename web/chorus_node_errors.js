// ComfyUI 0.3.64 lists a failed validate_inputs once under every input the method takes: one
// problem of a Chorus node (a bad bank name, min_density above max_density) would show two or
// three times in the error dialog. Keep each problem once, on the input its message names
// first. No imports and no DOM, so it is unit-tested in Node.js (tests/test_browser_view_model.py).

const CUSTOM = "custom_validation_failed";

// "max_density - min_density (0.7) must not exceed ..." -> "min_density (0.7) must not exceed ..."
function problemOf(error) {
  const name = error?.extra_info?.input_name;
  const details = String(error?.details ?? "");
  return name && details.startsWith(`${name} - `) ? details.slice(name.length + 3) : details;
}

// Where the message names the input as a whole word ("bank" is not in "new_bank_name").
function position(problem, name) {
  const escaped = String(name).replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  const found = new RegExp(`(^|[^\\w])${escaped}(?![\\w])`).exec(problem);
  return found ? found.index + found[1].length : Infinity;
}

function firstNamed(errors, problem) {
  const at = (error) => position(problem, error.extra_info?.input_name);
  return errors.reduce((best, error) => (at(error) < at(best) ? error : best));
}

// One node's errors with each custom validation problem once; other errors as they came.
export function onceEach(errors) {
  const groups = new Map();
  const kept = [];
  for (const error of errors ?? []) {
    if (error?.type !== CUSTOM) {
      kept.push(error);
      continue;
    }
    const problem = problemOf(error);
    if (!groups.has(problem)) {
      groups.set(problem, []);
      kept.push(problem); // a placeholder keeps the order
    }
    groups.get(problem).push(error);
  }
  return kept.map((item) => (typeof item === "string" ? firstNamed(groups.get(item), item) : item));
}

// The server's node_errors ({node id: {class_type, errors, ...}}), Chorus nodes' errors each once.
export function chorusErrorsOnce(nodeErrors) {
  for (const entry of Object.values(nodeErrors ?? {})) {
    if (String(entry?.class_type ?? "").startsWith("Chorus") && Array.isArray(entry.errors)) {
      entry.errors = onceEach(entry.errors);
    }
  }
  return nodeErrors;
}
