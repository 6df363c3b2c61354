// What the API request fuzzers share: a ServedModel without a model or an engine (so nothing is
// generated), with a small real tokenizer and the real chat templates of tests/fixtures. Each
// target runs a body through parse_body and its endpoint's parse_*_request (server/requests.h),
// the functions the handlers call, so it covers everything a request does before the model runs:
// every field check, the prompt rendered and encoded, the context shift, max_tokens.
#pragma once

#include <string>
#include <vector>

#include "fuzz_util.h"
#include "server/generation.h"
#include "text/chat_template.h"

namespace moestream::fuzz {

class ApiFixture {
 public:
  // A small context, so that long inputs meet the context shift and its errors.
  static constexpr int64_t kCtx = 512;
  static ApiFixture& get() {
    static ApiFixture fixture;
    return fixture;
  }
  ApiFixture() {
    const std::string root = source_dir() + "/tests/fixtures";
    model.id = "fuzz";
    model.tokenizer = Tokenizer::load(root + "/models/qwen3moe_ppl");
    templates.push_back(ChatTemplate::load(root + "/serve/qwen3_tiny_chat"));
    for (const char* name : {"qwen3", "qwen3-coder", "gpt-oss-120b", "deepseek-v3.1", "glm-4.5", "glm-4.6",
                             "mistral-nemo-instruct-2407", "mixtral-8x7b-instruct-v0.1"}) {
      const std::string src = read_file(root + "/templates/" + name + ".jinja");
      templates.push_back(ChatTemplate::from_source(src, {{"bos_token", "<s>"}, {"eos_token", "</s>"}}));
    }
    for (ChatTemplate& t : templates) t.fixed_time = 1700000000;
  }
  // The model with one of the templates, chosen by the input's size so that an input always meets
  // the same one (reproducible), and mutations that change the length try the others.
  ServedModel& for_input(size_t size) {
    model.chat_template = templates[size % templates.size()];
    return model;
  }

 private:
  ServedModel model;
  std::vector<ChatTemplate> templates;
};

}  // namespace moestream::fuzz
