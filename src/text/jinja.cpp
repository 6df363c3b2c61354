// Template: parse once, render many times (from any thread).
#include "text/jinja.h"

#include <new>
#include <stdexcept>

#include "text/jinja_ast.h"
#include "text/jinja_interp.h"
#include "text/limits.h"

namespace moestream::jinja {

namespace {

[[noreturn]] void rethrow(const RenderError& e, const std::string& name) {
  std::string what = name + " line " + std::to_string(e.line) + ": ";
  what += e.type == "TemplateError" ? e.message : e.type + ": " + e.message;
  throw TemplateError(what, e.type, e.message, e.line);
}

const FrameP& globals() {
  static const FrameP g = make_globals();  // never written after this: shared by all renders
  return g;
}

}  // namespace

Template Template::parse(std::string_view source, std::string name) {
  Template t;
  try {
    t.program_ = parse_program(source, name);
  } catch (const RenderError& e) {
    rethrow(e, name);
  }
  return t;
}

const std::string& Template::name() const { return program_->name; }

std::string Template::render(const nlohmann::ordered_json& variables, const RenderOptions& options) const {
  if (!program_) throw Error("jinja: render of an empty Template");
  if (!variables.is_object()) throw Error(program_->name + ": template variables must be a JSON object");
  auto context = std::make_shared<Frame>(globals());
  context->vars.reserve(variables.size());
  for (auto it = variables.begin(); it != variables.end(); ++it) {
    check_json_depth(it.value(), program_->name + ": template variable '" + it.key() + "'");
    context->set(it.key(), from_json(it.value()));
  }
  auto root = std::make_shared<Frame>(context);
  Interp interp(options.now ? *options.now : std::time(nullptr),
                options.max_steps > 0 ? options.max_steps : text_limits::kMaxRenderSteps);
  std::string out;
  try {
    ByteBudget budget(options.max_bytes > 0 ? options.max_bytes : text_limits::kMaxRenderBytes);
    interp.render(program_->body, root, out);
  } catch (const RenderError& e) {
    rethrow(e, program_->name);
  } catch (const std::length_error&) {  // the limits should catch these first
    rethrow(RenderError{"MemoryError", "a value grew too large", 0}, program_->name);
  } catch (const std::bad_alloc&) {
    rethrow(RenderError{"MemoryError", "out of memory", 0}, program_->name);
  }
  return out;
}

}  // namespace moestream::jinja
