"""The `language` perturbation's instructions: LIBERO-Pro's paraphrase of every task of LIBERO's four suites.

A fixed list, not generated at run time. Each entry is the `(:language ...)` line of LIBERO-Pro's
"semantic perturbation" task files, `libero/libero/bddl_files/<suite>_lan/<task>.bddl` (LIBERO-Pro,
Zhou et al., arXiv 2510.03827, "Semantic: paraphrases natural language commands"; the
`libero_*_lan` suites of its evaluation). LIBERO-Pro publishes these files in its Hugging Face dataset
(`zhouxueyang/LIBERO-Pro`); they were read here from two public copies that agree on every line
checked: nct-tso-robotics/simulation_libero at commit 41786bc4a531b8b4ef5eec875b7076727096c600 (all
40 read) and uynitsuj/LIBERO-PRO at commits 47aaa80 / 7b053e6 (a fork of Zxy-MLlab/LIBERO-PRO;
libero_10 task KITCHEN_SCENE3 and libero_goal's open_the_middle_drawer_of_the_cabinet compared).
LIBERO-Pro gives one paraphrase per task, so the perturbation's strength is 0 or 1. Its wording is
kept as published, typography included (the typographic apostrophe in two libero_goal lines).

Keys: (suite, LIBERO's task name, i.e. the task's BDDL file name without `.bddl`), in each suite's
task order. LIBERO-90 has no paraphrases in LIBERO-Pro: the perturbation refuses its tasks.
"""

from __future__ import annotations

PARAPHRASES: dict[tuple[str, str], str] = {
    ("libero_spatial", "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"):
        "lift the black bowl between the plate and ramekin and set it on the plate",
    ("libero_spatial", "pick_up_the_black_bowl_next_to_the_ramekin_and_place_it_on_the_plate"):
        "take black bowl next to ramekin and place on plate",
    ("libero_spatial", "pick_up_the_black_bowl_from_table_center_and_place_it_on_the_plate"):
        "lift the black bowl from the table center and put it on the plate",
    ("libero_spatial", "pick_up_the_black_bowl_on_the_cookie_box_and_place_it_on_the_plate"):
        "lift black bowl from cookie box and put it on plate",
    ("libero_spatial", "pick_up_the_black_bowl_in_the_top_drawer_of_the_wooden_cabinet_and_place_it_on_the_plate"):
        "take the black bowl from the top drawer and put it on plate",
    ("libero_spatial", "pick_up_the_black_bowl_on_the_ramekin_and_place_it_on_the_plate"):
        "grab black bowl on ramekin and set it on plate",
    ("libero_spatial", "pick_up_the_black_bowl_next_to_the_cookie_box_and_place_it_on_the_plate"):
        "grab the black bowl beside the cookie box and set it on plate",
    ("libero_spatial", "pick_up_the_black_bowl_on_the_stove_and_place_it_on_the_plate"):
        "lift bowl from stove and set on plate",
    ("libero_spatial", "pick_up_the_black_bowl_next_to_the_plate_and_place_it_on_the_plate"):
        "pick the bowl beside the plate and put it on plate",
    ("libero_spatial", "pick_up_the_black_bowl_on_the_wooden_cabinet_and_place_it_on_the_plate"):
        "lift bowl from cabinet and put on plate",
    ("libero_object", "pick_up_the_alphabet_soup_and_place_it_in_the_basket"):
        "grab alphabet soup and put it into basket",
    ("libero_object", "pick_up_the_cream_cheese_and_place_it_in_the_basket"):
        "grab cream cheese and put into basket",
    ("libero_object", "pick_up_the_salad_dressing_and_place_it_in_the_basket"):
        "grab salad dressing and put into basket",
    ("libero_object", "pick_up_the_bbq_sauce_and_place_it_in_the_basket"):
        "pick up bbq sauce and put it into basket",
    ("libero_object", "pick_up_the_ketchup_and_place_it_in_the_basket"):
        "lift ketchup and put it in basket",
    ("libero_object", "pick_up_the_tomato_sauce_and_place_it_in_the_basket"):
        "pick tomato sauce and put it in basket",
    ("libero_object", "pick_up_the_butter_and_place_it_in_the_basket"):
        "grab butter and put it into basket",
    ("libero_object", "pick_up_the_milk_and_place_it_in_the_basket"):
        "grab milk and put into basket",
    ("libero_object", "pick_up_the_chocolate_pudding_and_place_it_in_the_basket"):
        "lift chocolate pudding and put it in basket",
    ("libero_object", "pick_up_the_orange_juice_and_place_it_in_the_basket"):
        "pick orange juice and put into basket",
    ("libero_goal", "open_the_middle_drawer_of_the_cabinet"):
        "open the cabinet’s middle drawer",
    ("libero_goal", "put_the_bowl_on_the_stove"):
        "place the bowl on the stove",
    ("libero_goal", "put_the_wine_bottle_on_top_of_the_cabinet"):
        "place the wine bottle on top of the cabinet",
    ("libero_goal", "open_the_top_drawer_and_put_the_bowl_inside"):
        "slide open the top drawer and place the bowl in it",
    ("libero_goal", "put_the_bowl_on_top_of_the_cabinet"):
        "place the bowl on top of the cabinet",
    ("libero_goal", "push_the_plate_to_the_front_of_the_stove"):
        "move the plate to the stove’s front",
    ("libero_goal", "put_the_cream_cheese_in_the_bowl"):
        "place the cream cheese inside the bowl",
    ("libero_goal", "turn_on_the_stove"):
        "switch on the stove",
    ("libero_goal", "put_the_bowl_on_the_plate"):
        "place the bowl on top of the plate",
    ("libero_goal", "put_the_wine_bottle_on_the_rack"):
        "place the wine bottle on the rack",
    ("libero_10", "LIVING_ROOM_SCENE2_put_both_the_alphabet_soup_and_the_tomato_sauce_in_the_basket"):
        "place alphabet soup and tomato sauce into basket",
    ("libero_10", "LIVING_ROOM_SCENE2_put_both_the_cream_cheese_box_and_the_butter_in_the_basket"):
        "place cream cheese box and butter into basket",
    ("libero_10", "KITCHEN_SCENE3_turn_on_the_stove_and_put_the_moka_pot_on_it"):
        "switch stove on and put moka pot on it",
    ("libero_10", "KITCHEN_SCENE4_put_the_black_bowl_in_the_bottom_drawer_of_the_cabinet_and_close_it"):
        "put black bowl inside bottom drawer and close it",
    ("libero_10", "LIVING_ROOM_SCENE5_put_the_white_mug_on_the_left_plate"
                  "_and_put_the_yellow_and_white_mug_on_the_right_plate"):
        "place white mug on left plate and yellow-white mug on right plate",
    ("libero_10", "STUDY_SCENE1_pick_up_the_book_and_place_it_in_the_back_compartment_of_the_caddy"):
        "pick up the book and place in back compartment",
    ("libero_10", "LIVING_ROOM_SCENE6_put_the_white_mug_on_the_plate"
                  "_and_put_the_chocolate_pudding_to_the_right_of_the_plate"):
        "place white mug on plate and chocolate pudding to right",
    ("libero_10", "LIVING_ROOM_SCENE1_put_both_the_alphabet_soup_and_the_cream_cheese_box_in_the_basket"):
        "put alphabet soup and cream cheese box in basket",
    ("libero_10", "KITCHEN_SCENE8_put_both_moka_pots_on_the_stove"):
        "place both moka pots on stove",
    ("libero_10", "KITCHEN_SCENE6_put_the_yellow_and_white_mug_in_the_microwave_and_close_it"):
        "place yellow and white mug in microwave and close door",
}
